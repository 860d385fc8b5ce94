"""The two-node Soft-RoCE lab: QEMU guests ``prefill`` and ``decode``."""
