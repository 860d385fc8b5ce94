"""Finding receivers: the static ``[peers]`` list, or an etcd registry."""
