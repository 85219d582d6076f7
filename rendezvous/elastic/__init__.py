"""rendezvous.elastic."""
