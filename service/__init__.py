"""The tidal coordinator, its client and the `tidal` command line.

* :mod:`service.api`: the wire schema both sides share;
* :mod:`service.coordinator`: the coordinator process (app, routes, reconcile loop);
* :mod:`service.scheduler`: the pure scheduling decisions the reconcile loop applies;
* :mod:`service.client`: the Python client (``from service.client import Client``);
* :mod:`service.cli`: the ``tidal`` command, one module per noun;
* :mod:`service.up`: ``tidal up``, a local cluster; :mod:`service.ui`: the web page.

It talks to etcd through :mod:`rendezvous` only and never imports torch.
"""
