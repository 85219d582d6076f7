"""The tidal coordinator: HTTP API, scheduler, and the `tidal` command line.

It talks to etcd through :mod:`rendezvous` only and never imports torch.
"""
