"""The loaders batchd is compared against: the sequential loop, PyTorch DataLoader (photos, COCO), tf.data."""
