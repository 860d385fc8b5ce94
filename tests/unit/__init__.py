"""Tests that need nothing but this machine: daemons in one process, over TCP
on loopback, and I/O-free cores (make unit)."""
