"""The ``satisfice`` command: serve, config, engines and keys here; the cache, router
and evaluator command groups in this package's modules of those names. Each command is
a thin shell: its logic lives in the package that owns it."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import sys
from pathlib import Path

import msgspec

from cache.pairs import PairFileError
from cache.standalone import StoreKeepsNothing
from engines.bundled import model_file
from engines.native_check import LlamaCppUnusable, check_models
from engines.settings import LlamaCppSettings
from evaluator.answers import QuestionFileError
from evaluator.calibration import (
    CalibratorFileError,
    calibrator_file,
    read_calibrator,
    read_greedy_calibrators,
)
from gateway.cli import cache as cache_commands
from gateway.cli import evaluator as evaluator_commands
from gateway.cli import policy as policy_commands
from gateway.cli import quality as quality_commands
from gateway.cli import router as router_commands
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config.docs import render_reference
from gateway.ops.keys import KeyTable, hash_key
from gateway.ops.logs import configure_logging
from router.model_file import RouterFileError
from router.outcomes import OutcomeError


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.api.app import create_app
    from gateway.api.server import server_config

    def adjust(config: GatewayConfig) -> GatewayConfig:
        """The command line's host and port over the file's, on each (re)load."""
        server = msgspec.structs.replace(
            config.server,
            host=args.host or config.server.host,
            port=config.server.port if args.port is None else args.port,
        )
        return msgspec.structs.replace(config, server=server)

    config = adjust(load_config(args.config))
    configure_logging(config.server)
    # Should a native library crash this process after all, it says where on stderr.
    faulthandler.enable()
    failures: list[str] = []

    def stop(failure: str) -> None:
        failures.append(failure)
        server.should_exit = True

    path = None if args.config is None else Path(args.config)
    app = create_app(config, path, adjust, on_start_failure=stop)
    refused = app.state.runtime.metrics.connection_refused
    server = uvicorn.Server(server_config(app, config.server, refused))
    server.run()
    if failures:
        print(f"error: the gateway could not start: {failures[0]}", file=sys.stderr)
        return 3
    return 0 if server.started else 3


def _engines_check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    models_dir = Path(config.models_dir).expanduser()
    models = {
        name: model_file(settings.model, models_dir)
        for name, settings in config.engines.items()
        if isinstance(settings, LlamaCppSettings)
    }
    if not models:
        print("no in-process engines to check")
        return 0
    threads = max(s.threads for s in config.engines.values() if isinstance(s, LlamaCppSettings))
    try:
        seconds = asyncio.run(check_models(list(models.values()), threads))
    except LlamaCppUnusable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    engines = ", ".join(f"{name} ({path.name})" for name, path in models.items())
    print(f"llama.cpp generates on this host: {engines}, in {seconds:.1f} s")
    return 0


def _config_check(args: argparse.Namespace) -> int:
    config: GatewayConfig = load_config(args.file)
    if config.loop is not None:
        loop = config.loop
        # The files the loop would read: its vote's, and the greedy pass's when it has one.
        if loop.calibrator is not None:
            read_calibrator(calibrator_file(loop.calibrator))
        greedy = loop.greedy_calibrator_in_use()
        if greedy is not None:
            read_greedy_calibrators(greedy)
    KeyTable(config.auth, config.server.admin_key)  # keys from the environment are set
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


def _keys_hash(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("error: no key given (an argument, or one line on stdin)", file=sys.stderr)
        return 2
    print(hash_key(key))
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

    engines = commands.add_parser("engines", help="the configured engines")
    engines_commands = engines.add_subparsers(dest="engines_command", required=True)
    engines_check = engines_commands.add_parser(
        "check",
        help="generate a few tokens with each in-process model in a child process: "
        "does this host run the llama.cpp library that was built?",
    )
    engines_check.add_argument("--config", help="YAML config file (default: the embedded default)")
    engines_check.set_defaults(run=_engines_check)

    keys = commands.add_parser("keys", help="API keys")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    hashed = keys_commands.add_parser(
        "hash", help="print a key's SHA-256, for auth.keys.<name>.sha256 in the config"
    )
    hashed.add_argument("key", nargs="?", help="the key (default: one line on stdin)")
    hashed.set_defaults(run=_keys_hash)

    router_commands.add_commands(commands)
    cache_commands.add_commands(commands)
    evaluator_commands.add_commands(commands)
    quality_commands.add_commands(commands)
    policy_commands.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    except (
        OutcomeError,
        RouterFileError,
        CalibratorFileError,
        QuestionFileError,
        PairFileError,
        StoreKeepsNothing,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code
