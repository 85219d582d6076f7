"""Everything torch.distributed.elastic calls: the rendezvous handlers, their
store in etcd, and the round and liveness logic they share.

* :mod:`rendezvous.elastic.assigned`: A rendezvous for nodes that know who is coming:
  tidal's agents.
* :mod:`rendezvous.elastic.assigned_join`: This node's own join record in the assigned
  rendezvous, and keeping it there.
* :mod:`rendezvous.elastic.assigned_leader`: The round leader of the assigned
  rendezvous: the one member that writes rounds, fenced by its key's revision.
* :mod:`rendezvous.elastic.assigned_state`: The one-writer rounds' small records (state,
  rank) and their pure decisions (the leader's round, a member's change, the ring).
* :mod:`rendezvous.elastic.assigned_rounds`: The assigned rendezvous's records and its
  pure decisions about rounds.
* :mod:`rendezvous.elastic.etcd_v3`: The etcd-v3 rendezvous backend and c10d Store for
  torch.distributed.elastic.
* :mod:`rendezvous.elastic.liveness`: Know within milliseconds that a peer's process
  died: a TCP socket per peer.
* :mod:`rendezvous.elastic.store`: A c10d ``Store`` kept in etcd (:class:`EtcdV3Store`),
  and how the rendezvous ...
"""
