"""Command line (``shardformer run ...``) and the config-file loader the example scripts use.

``shardformer.cli.main`` is deliberately not imported here, so ``python -m shardformer.cli.main`` runs cleanly.
"""

from shardformer.cli.config_file import BASE_KEYS, Config, ConfigError, Key, build_config, load_config
from shardformer.cli.example_args import parse_example_args, parse_overrides

__all__ = [
    "BASE_KEYS",
    "Config",
    "ConfigError",
    "Key",
    "build_config",
    "load_config",
    "parse_example_args",
    "parse_overrides",
]
