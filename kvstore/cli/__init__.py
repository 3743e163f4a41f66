"""The `kvstore` command (`kvstore.cli.main:main`): serve, stats, info, top, ls, evict,
flush, pin, config, events, export/import, health, replay, bench. Nothing imports it."""
