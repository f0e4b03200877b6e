"""Planning a job: which layout fits a model, a batch and a cluster, and trains fastest."""
