"""Plumbing under every strategy: launching ranks, the pool, rendezvous, devices, the trace and its pictures."""
