"""The ``satisfice`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from evaluator.calibration import CalibratorFileError, calibrator_file, read_calibrator
from gateway.cache_commands import add_commands as add_cache_commands
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config_docs import render_reference
from gateway.evaluator_commands import add_commands as add_evaluator_commands
from gateway.logs import configure_logging
from gateway.router_commands import add_commands as add_router_commands
from router.model_file import RouterFileError
from router.outcomes import OutcomeError


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    config = load_config(args.config)
    server = msgspec.structs.replace(
        config.server,
        host=args.host or config.server.host,
        port=config.server.port if args.port is None else args.port,
    )
    config = msgspec.structs.replace(config, server=server)
    configure_logging(server)
    uvicorn.run(
        create_app(config),
        host=server.host,
        port=server.port,
        log_level="info",
        log_config=None,  # configure_logging's handler serves uvicorn's loggers too
        timeout_graceful_shutdown=30,
    )
    return 0


def _config_check(args: argparse.Namespace) -> int:
    config: GatewayConfig = load_config(args.file)
    if config.loop is not None and config.loop.calibrator is not None:
        read_calibrator(calibrator_file(config.loop.calibrator))
    print(f"{args.file}: ok ({len(config.engines)} engines: {', '.join(config.engines)})")
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    text = render_reference()
    if args.out is None:
        # UTF-8 whatever the locale says: the reference writes bounds as ≥ and ≤.
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
        return 0
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="satisfice",
        description="An OpenAI-compatible LLM gateway that thinks just long enough.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--config", help="YAML config file (default: the embedded default)")
    serve.add_argument("--host", help="address to bind (default: from the config)")
    serve.add_argument("--port", type=int, help="port to bind (default: from the config)")
    serve.set_defaults(run=_serve)

    config = commands.add_parser("config", help="work with config files")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate a config file without serving")
    check.add_argument("file")
    check.set_defaults(run=_config_check)
    docs = config_commands.add_parser(
        "docs", help="print the config reference (docs/configuration.md) generated from the code"
    )
    docs.add_argument("--out", help="write it to this file instead of printing it")
    docs.set_defaults(run=_config_docs)

    add_router_commands(commands)
    add_cache_commands(commands)
    add_evaluator_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    except (OutcomeError, RouterFileError, CalibratorFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
