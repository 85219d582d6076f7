"""The tidal node agent: registers a node in etcd and runs the workers of the
jobs assigned to it through torch.distributed.elastic."""
