"""`rldock env serve`: an environment class served over OpenEnv's protocol until SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys

from rldock.runtime.cli.arguments import parse_option, positive_int


def add_commands(commands: argparse._SubParsersAction) -> None:
    env = commands.add_parser("env", help="environments as services (docs/agentic.md#environments-as-services)")
    env_commands = env.add_subparsers(dest="env_command", required=True)
    serve = env_commands.add_parser(
        "serve",
        help="serve an environment class over OpenEnv's protocol (HTTP, and a WebSocket per episode) until "
        "SIGTERM, which closes every session",
    )
    serve.add_argument(
        "environment",
        metavar="CLASS",
        type=os.path.expanduser,  # `~/my_env.py:MyEnv` in a container's command, which no shell expands
        help="a built-in environment (feedback) or your own class, path/to/file.py:Class or package.module:Class",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one, logged)")
    serve.add_argument(
        "--sessions",
        type=positive_int,
        default=8,
        metavar="N",
        help="sessions (episodes) open at once; one more is refused with CAPACITY_REACHED (default 8)",
    )
    serve.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="serve on this inherited listening socket instead of --host/--port (rldock train passes one it "
        "bound, `{listen_fd}` in servers.command)",
    )
    serve.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the job's token, which every route but /health then asks for (a mounted Secret's "
        "key); default: the RLDOCK_ENV_TOKEN variable, if set, else no token",
    )
    serve.add_argument(
        "--option",
        dest="options",
        action="append",
        type=parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument (a string) of your class, as agent.environment.options; repeatable",
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Exit 2 for a class or option that cannot be served, else serve until stopped."""
    from rldock.runtime.agent.builders import AgentConfigError
    from rldock.runtime.agent.service.auth import TokenError, server_token
    from rldock.runtime.env_server.serve import inherited, listen, load_environment, serve

    options: dict[str, str] = {}
    for key, value in args.options:
        if key in options:
            print(f"error: --option: {key} is given twice; give each option once", file=sys.stderr)
            return 2
        options[key] = value
    try:
        token = server_token(args.token_file)
    except TokenError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        environment = load_environment(args.environment, options)
    except AgentConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port) if args.listen_fd is None else inherited(args.listen_fd)
    except OSError as error:
        environment.close()
        where = (
            f"--listen-fd: cannot listen on descriptor {args.listen_fd}"
            if args.listen_fd is not None
            else f"--host/--port: cannot listen on {args.host}:{args.port}"
        )
        print(f"error: {where}: {error}", file=sys.stderr)
        return 2
    serve(environment, sock=sock, max_sessions=args.sessions, token=token)
    return 0
