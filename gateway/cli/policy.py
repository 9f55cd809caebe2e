"""`satisfice policy`: refit the router, the loop's calibrator and the verifier's
calibration from the outcome store as a new policy version, and move versions into
shadow, into force, and back; a shell over gateway.checks.learn and .versions.

A running gateway sharing the store follows a move within a few seconds, no restart."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import msgspec

from cache.calibration import BUNDLED as BUNDLED_CALIBRATION
from cache.calibration import Calibration, read_calibration
from evaluator.calibration import Calibrator, calibrator_file, read_calibrator
from gateway.checks.learn import InForce, learn
from gateway.checks.record import CheckRecord
from gateway.checks.store import create_outcome_store
from gateway.checks.versions import (
    SHIPPED,
    Manifest,
    PolicyState,
    PolicyStore,
    PolicyVersion,
    after,
    check_id,
    create_policy_store,
)
from gateway.cli.router import embed_prompts
from gateway.config import GatewayConfig, load_config
from gateway.config.shadow import ShadowSettings
from router.model_file import RouterModel, read_router
from router.router import router_file


def _stores(config: GatewayConfig) -> PolicyStore:
    return create_policy_store(config.shadow or ShadowSettings(), config.cache)


def _in_force(config: GatewayConfig, active: PolicyVersion | None) -> InForce:
    """The parts of the version in force: the config's files, replaced by the active
    version's where it has its own."""
    router: RouterModel | None = None
    if config.router is not None:
        router = read_router(router_file(config.router))
    calibrator: Calibrator | None = None
    if config.loop is not None and config.loop.calibrator is not None:
        calibrator = read_calibrator(calibrator_file(config.loop.calibrator))
    verifier: Calibration | None = None
    cache = config.cache
    if cache is not None and cache.verifier is not None:
        verifier = read_calibration(cache.verifier.calibration or BUNDLED_CALIBRATION)
    if active is not None:
        router = active.router or router
        calibrator = active.calibrator or calibrator
        verifier = active.verifier or verifier
    return InForce(
        version=SHIPPED if active is None else active.manifest.id,
        router=router,
        router_threshold=None if config.router is None else config.router.threshold,
        calibrator=calibrator,
        loop_threshold=None if config.loop is None else config.loop.threshold,
        verifier=verifier,
        max_false_hit_rate=None if cache is None else cache.max_false_hit_rate,
    )


def refit(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    outcomes = create_outcome_store(config.shadow or ShadowSettings(), config.cache)
    policies = _stores(config)

    async def read() -> tuple[list[CheckRecord], PolicyVersion | None]:
        try:
            records = await outcomes.read()
            state = await policies.state()
            active = None if state.active == SHIPPED else await policies.get(state.active)
            return records, active
        finally:
            await outcomes.close()

    while True:
        records, active = asyncio.run(read())
        version = learn(
            records, _in_force(config, active), lambda p: embed_prompts(config, p),
            calibrate_on_agreement=args.calibrator_on_agreement,
        )  # fmt: skip
        if not version.manifest.fitted:
            print(_shown(version.manifest))
            print("nothing refitted: too few checks for any part", file=sys.stderr)
        else:
            asyncio.run(_put(policies, version, shadow=args.shadow))
            print(_shown(version.manifest))
            print(f"wrote policy version {version.manifest.id} to {policies.where}"
                  + (" and put it in shadow" if args.shadow else ""))  # fmt: skip
        if args.every is None:
            asyncio.run(policies.close())
            return 0
        time.sleep(args.every * 3600)


async def _put(policies: PolicyStore, version: PolicyVersion, *, shadow: bool) -> None:
    await policies.put(version)
    if shadow:
        await policies.set_state(after(await policies.state(), "shadow", version.manifest.id))


def _shown(manifest: Manifest) -> str:
    """A version as a person reads it: what was refitted on what, and how it compares
    with the version it came from on the checks it never saw."""
    lines = [
        f"{manifest.id} (from {manifest.parent}, {manifest.records} outcome records)",
        "  refitted: " + (", ".join(f"{k} on {n} labels" for k, n in manifest.fitted.items())
                          or "nothing"),
    ]  # fmt: skip
    for c in manifest.comparisons:
        lines.append(f"  {c.part}, on {c.checks} held-out checks (disagreement with the "
                     "skipped path, 95% interval; then what it spends):")  # fmt: skip
        for name, rate, cost in (
            ("in force", c.live, c.live_cost), ("refitted", c.candidate, c.candidate_cost)
        ):  # fmt: skip
            shown = "-" if rate.rate is None else (
                f"{rate.rate:.1%} [{rate.low:.1%}, {rate.high:.1%}] over {rate.n:.0f}"
            )  # fmt: skip
            spent = "-" if cost is None else f"{cost:.1%}"
            lines.append(f"    {name:9} {shown}; {c.cost}: {spent}")
    lines += [f"  note: {note}" for note in manifest.notes]
    return "\n".join(lines)


def listed(args: argparse.Namespace) -> int:
    policies = _stores(load_config(args.config))

    async def read() -> tuple[PolicyState, list[Manifest]]:
        try:
            return await policies.state(), await policies.manifests()
        finally:
            await policies.close()

    state, manifests = asyncio.run(read())
    if args.json:
        print(msgspec.json.encode({"state": state, "versions": manifests}).decode())
        return 0
    print(f"in force: {state.active}; in shadow: {state.shadow or 'none'}; "
          f"revert goes to: {state.previous or SHIPPED}")  # fmt: skip
    for manifest in manifests:
        print(_shown(manifest))
    return 0


def moved(args: argparse.Namespace) -> int:
    policies = _stores(load_config(args.config))
    version = getattr(args, "version", None)

    async def move() -> PolicyState:
        try:
            if version is not None and await policies.get(check_id(version)) is None:
                raise SystemExit(f"error: no policy version {version!r} in {policies.where}")
            state = after(await policies.state(), args.policy_command, version)
            await policies.set_state(state)
            return state
        finally:
            await policies.close()

    state = asyncio.run(move())
    print(f"in force: {state.active}; in shadow: {state.shadow or 'none'} "
          "(running gateways follow within a few seconds)")  # fmt: skip
    return 0


def _hours(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of hours")
    return value


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = commands.add_parser(
        "policy", help="refit from the shadow checks, and shadow, activate or revert versions"
    )
    sub = policy.add_subparsers(dest="policy_command", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="the gateway's config (default: the embedded "
                            "default): it says where the stores are")  # fmt: skip

    refit_ = sub.add_parser("refit", help="a new version from the outcome store")
    common(refit_)
    refit_.add_argument("--shadow", action="store_true", help="put it in shadow at once")
    refit_.add_argument(
        "--calibrator-on-agreement", action="store_true",
        help="also fit the loop's calibrator to early stops' agreement with the budget's "
        "answer: its P then means 'thinking on would not change this', not 'correct'",
    )  # fmt: skip
    refit_.add_argument("--every", type=_hours, metavar="HOURS",
                        help="refit again every HOURS (a schedule), until stopped")  # fmt: skip
    refit_.set_defaults(run=refit)
    list_ = sub.add_parser("list", help="the versions, and which is in force and in shadow")
    common(list_)
    list_.add_argument("--json", action="store_true")
    list_.set_defaults(run=listed)
    for name, what in (("shadow", "run VERSION in shadow beside the one in force"),
                       ("activate", "put VERSION in force")):  # fmt: skip
        parser = sub.add_parser(name, help=what)
        common(parser)
        parser.add_argument("version", metavar="VERSION")
        parser.set_defaults(run=moved)
    for name, what in (("revert", "put the version in force before the last activate back"),
                       ("unshadow", "stop running a version in shadow")):  # fmt: skip
        parser = sub.add_parser(name, help=what)
        common(parser)
        parser.set_defaults(run=moved)
