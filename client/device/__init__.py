"""Where batches land: tensors on the device, GPU finishing, decoding on the client, collation."""
