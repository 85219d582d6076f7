"""The wire schema: what a user submits, what etcd holds, what the API answers.
The coordinator, the client and the command line all import it.

* :mod:`service.api.models`: The coordinator's data: what a user submits, what etcd
  holds, what the API answers.
* :mod:`service.api.queues`: Queues: a team's guaranteed share of the cluster, its limit
  and its weight.
"""
