"""One pass over an epoch: who builds which batch (credit), the reorder buffer, resume."""
