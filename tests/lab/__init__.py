"""Tests that need the two-node QEMU lab with rdma_rxe (one boot, shared)."""
