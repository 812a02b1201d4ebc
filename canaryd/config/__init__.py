"""Configuration: flags > environment > the operator's config file > defaults.

Parsed once, at the edge, into a typed ``Settings``; nothing else sees strings. Its
parts, each importing only those below it in this list (pyproject.toml's import
contracts check it):

- ``flags``: the command line and the environment, resolved into ``Settings``;
- ``operator_config``: the operator's own config file, and what canaryd takes from it;
- ``settings``: ``Settings`` and the timings derived from them;
- ``values``: durations and booleans from text, and ``ConfigError``.
"""

from canaryd.config.flags import (
    CUSTOM_KIND,
    DURATION_FLAGS,
    KNOWN_KINDS,
    LOG_LEVELS,
    MIN_TIMEOUT,
    RECONCILED_BY,
    build_parser,
    load_settings,
    operator_config_values,
)
from canaryd.config.operator_config import (
    ALL_NAMESPACES_VALUE,
    CONFIG_FILE_NAMES,
    DEFAULT_REPORTER_PORT,
    KEY_CHECK_INTERVAL,
    KEY_DYNAMIC,
    KEY_NAMESPACES,
    KEY_PORT,
    KEY_TIMEOUT,
    PROM_FACTORY,
    REPORTER_PORT_KEY,
    flatten,
    has_prometheus_reporter,
    nested_keys_why,
    nested_operator_keys,
    operator_config_file,
    operator_config_files,
    parse_namespaces,
    read_operator_config,
    reporter_url,
)
from canaryd.config.settings import (
    DEFAULT_KINDS,
    DEFAULT_LABEL,
    MIN_WRITE_TIMEOUT,
    SA_NAMESPACE_FILE,
    Settings,
    default_identity,
    lease_namespace,
    lease_seconds,
)
from canaryd.config.values import ConfigError, parse_bool, parse_duration

__all__ = [
    "ALL_NAMESPACES_VALUE",
    "CONFIG_FILE_NAMES",
    "CUSTOM_KIND",
    "DEFAULT_KINDS",
    "DEFAULT_LABEL",
    "DEFAULT_REPORTER_PORT",
    "DURATION_FLAGS",
    "KEY_CHECK_INTERVAL",
    "KEY_DYNAMIC",
    "KEY_NAMESPACES",
    "KEY_PORT",
    "KEY_TIMEOUT",
    "KNOWN_KINDS",
    "LOG_LEVELS",
    "MIN_TIMEOUT",
    "MIN_WRITE_TIMEOUT",
    "PROM_FACTORY",
    "RECONCILED_BY",
    "REPORTER_PORT_KEY",
    "SA_NAMESPACE_FILE",
    "ConfigError",
    "Settings",
    "build_parser",
    "default_identity",
    "flatten",
    "has_prometheus_reporter",
    "lease_namespace",
    "lease_seconds",
    "load_settings",
    "nested_keys_why",
    "nested_operator_keys",
    "operator_config_file",
    "operator_config_files",
    "operator_config_values",
    "parse_bool",
    "parse_duration",
    "parse_namespaces",
    "read_operator_config",
    "reporter_url",
]
