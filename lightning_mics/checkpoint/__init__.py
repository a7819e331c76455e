"""Checkpoints: model and optimizer state, full or sharded (DCP), the files on disk, the collective save
and load steps, tensors kept beside the model, and the error-feedback residuals."""
