"""A request's KV caches on a rank, beyond its stage's layers: where they come from and where they go.

The memory tier is mlx-lm's ``LRUPromptCache`` and the disk tier each rank's
own folder of mlx-lm prompt cache files (``disk_cache``); ``prompt_caches``
puts the two together, the ranks agreeing before any rank uses a cached prefix
its peers lack. While requests decode together, their caches on a stage are
one of mlx-lm's batch caches, merged as requests join a decode group and
filtered as they leave (``batch_caches``). The generation room's engine is
what uses them; nothing here imports it.

The rooms: ``prompt_caches`` (the two tiers, a request's caches fetched and
kept), ``disk_cache`` (the disk tier: entries, LRU bound, the writer thread),
``disk_files`` (a prefix's caches as mlx-lm's prompt cache file, written
without MLX) and ``batch_caches`` (the decode groups' merged caches).
"""
