"""``python -m agentrl.config``: print the configuration reference (``--markdown``), or a config
file resolved with its overrides as YAML (exit 2 with the error on a bad key or value)."""

from __future__ import annotations

import sys
from pathlib import Path

from agentrl.config.docs import config_markdown
from agentrl.config.loading import load_any_config
from agentrl.config.section import ConfigError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m agentrl.config --markdown`` or ``python -m agentrl.config FILE [k=v ...]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m agentrl.config",
        description="Print the configuration reference, or a resolved config as YAML.",
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    parser.add_argument("file", nargs="?", help="YAML config file (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    args = parser.parse_args(argv)
    if args.file is not None and "=" in args.file and not Path(args.file).exists():
        args.overrides.insert(0, args.file)
        args.file = None
    if args.markdown:
        sys.stdout.write(config_markdown())
        return 0
    try:
        cfg = load_any_config(args.file, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
