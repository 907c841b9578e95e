"""`ticketq-gateway` (also `python -m gateway`, `ticketq gateway`) and `ticketq-deliver` (`python -m
gateway deliver`, `ticketq deliver`), with its repair commands `ticketq-deliver dead [--redeliver]`
and `ticketq-deliver redeliver-trimmed`. Each reports under the name it was run by."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.settings import GatewaySettings
from ticketq.cli import version_line
from ticketq.config import SettingsError


def _settings(prog: str, **overrides: object) -> GatewaySettings:
    """The settings, or exit with their errors under `prog`'s own name."""
    try:
        return GatewaySettings.from_env(**overrides)
    except SettingsError as exc:
        sys.exit(f"{prog}: invalid settings:\n{exc}")


def _add_version(parser: argparse.ArgumentParser) -> None:
    """`--version` as on every other ticketq command (README): the same line, exit 0."""
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="show the version and exit")  # fmt: skip


def gateway_main(argv: list[str] | None = None, prog: str = "ticketq-gateway") -> None:
    """Serve the gateway with uvicorn (TLS is the ingress's)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.server import uvicorn_options

    parser = argparse.ArgumentParser(prog=prog, description="HTTP gateway: tickets in, results out.")
    parser.add_argument("--host", help="listen address (TICKETQ_GATEWAY_HOST)")
    parser.add_argument("--port", type=int, help="listen port (TICKETQ_GATEWAY_PORT)")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    _add_version(parser)
    args = parser.parse_args(argv)
    settings = _settings(parser.prog, gateway_host=args.host, gateway_port=args.port)
    if not settings.gateway_tokens and not settings.gateway_anonymous:
        sys.exit(f"{prog}: no bearer tokens: set TICKETQ_GATEWAY_TOKENS=name:SHA256HEX "
                 "(printf %s TOKEN | sha256sum), or TICKETQ_GATEWAY_ANONYMOUS=1 behind an authenticating ingress")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.gateway_host, port=settings.gateway_port, log_level=args.log_level,
                access_log=False, **uvicorn_options(settings, app.state.gateway.metrics))  # fmt: skip


def deliver_main(argv: list[str] | None = None, prog: str = "ticketq-deliver") -> None:
    """Deliver results by webhook until SIGTERM/SIGINT; or one of the repair commands."""
    from gateway.deliver import Dispatcher

    parser = argparse.ArgumentParser(prog=prog, description="POST each result to a webhook URL.")
    parser.add_argument("--url", help="receiver URL (TICKETQ_DELIVER_URL)")
    _add_version(parser)
    commands = parser.add_subparsers(dest="command", metavar="{dead,redeliver-trimmed}")
    dead = commands.add_parser("dead", help="list the delivery dead letters (--redeliver: POST each once more)")
    dead.add_argument("--redeliver", action="store_true", help="POST each again; delete those answered 2xx")
    trimmed = commands.add_parser("redeliver-trimmed", help="POST the stored results the stream trimmed undelivered")
    trimmed.add_argument("--margin-s", type=float, default=5.0,
                         help="also results stored this long before a trimmed range (default: 5)")  # fmt: skip
    args = parser.parse_args(argv)
    settings = _settings(parser.prog, deliver_url=args.url)
    if args.command == "dead" and not args.redeliver:
        _list_dead(settings)
        return
    if not settings.deliver_url and not settings.deliver_urls:
        sys.exit(f"{prog}: no receiver: set TICKETQ_DELIVER_URL (or TICKETQ_DELIVER_URLS=schema=url,...)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        Dispatcher(settings).run_forever()
        return
    from gateway import redeliver

    dispatcher = Dispatcher(settings)
    try:
        if args.command == "dead":
            done = redeliver.redeliver_dead(dispatcher)
        else:
            done = redeliver.redeliver_trimmed(dispatcher, args.margin_s)
    finally:
        dispatcher.close()
    print(done.line("delivered"))
    if done.failed:
        sys.exit(1)


def _list_dead(settings: GatewaySettings) -> None:
    from gateway import redeliver
    from gateway.deliver import Dispatcher

    dispatcher = Dispatcher(settings)
    try:
        letters = redeliver.dead_letters(dispatcher)
    finally:
        dispatcher.close()
    for letter in letters:
        print(f"{letter.dead_id}\t{letter.delivery_id}\t{letter.url}\t{letter.error}")
    print(f"{len(letters)} dead letter(s) in ticketq:deliver:dead", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["deliver"]:
        deliver_main(argv[1:])
    else:
        gateway_main(argv[1:] if argv[:1] == ["serve"] else argv)
