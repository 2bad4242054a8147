"""The KV-cache library plugins build on: block bookkeeping with prefix caching and eviction
(``block_pool``), and the paged KV-cache manager over it (``paged``), the built-in ``paged``
manager."""
