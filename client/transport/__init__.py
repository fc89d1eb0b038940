"""How batches travel: the gRPC call, shared memory, the data plane and its relay."""
