"""`ticketq-writeback`: write each answer back to its helpdesk until SIGTERM/SIGINT; `ticketq-writeback
dead [--redeliver]` lists (or writes again) the write-backs given up on."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway import redeliver
from gateway.writeback.settings import WritebackSettings
from ticketq.cli import version_line
from ticketq.config import SettingsError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ticketq-writeback", description="Write each answer back to the helpdesk "
                                     "ticket it came from (tags, group, custom fields).")  # fmt: skip
    parser.add_argument("--config", help="write-back targets, TOML (TICKETQ_WRITEBACK_CONFIG)")
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="show the version and exit")  # fmt: skip
    commands = parser.add_subparsers(dest="command", metavar="{dead}")
    dead = commands.add_parser("dead", help="list the write-back dead letters (--redeliver: write each once more)")
    dead.add_argument("--redeliver", action="store_true", help="write each again; delete those answered 2xx")
    args = parser.parse_args(argv)
    try:
        settings = WritebackSettings.from_env(writeback_config=args.config)
    except SettingsError as exc:
        sys.exit(f"ticketq-writeback: invalid settings:\n{exc}")
    from gateway.writeback.consumer import Writeback

    try:
        writeback = Writeback(settings)
    except (ValueError, OSError) as exc:
        sys.exit(f"ticketq-writeback: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        writeback.run_forever()
        return
    try:
        if not args.redeliver:
            letters = redeliver.dead_letters(writeback)
            for letter in letters:
                print(f"{letter.dead_id}\t{letter.delivery_id}\t{letter.url}\t{letter.error}")
            print(f"{len(letters)} dead letter(s) in {writeback.dead_stream}", file=sys.stderr)
            return
        done = redeliver.redeliver_dead(writeback)
    finally:
        writeback.close()
    print(done.line("written"))
    if done.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
