"""Ports and sockets for the tests that start servers: one free loopback port, a JSON request, and
the sockets a process tree listens on (to prove a server binds loopback only)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def urlopen_json(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def non_loopback_listeners(pids: list[int]) -> tuple[list[str], list[int]]:
    """(the sockets of ``pids`` listening beyond loopback, as "pid name ip:port"; every port they
    listen on)."""
    import ipaddress

    import ray  # noqa: F401  (Ray's own psutil)

    # isort: split
    import psutil

    beyond, ports = [], []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            listening = [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # gone meanwhile
            continue
        for conn in listening:
            ip = ipaddress.ip_address(conn.laddr.ip)
            ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
            ports.append(conn.laddr.port)
            if not ip.is_loopback:
                beyond.append(f"{pid} {process.name()} {conn.laddr.ip}:{conn.laddr.port}")
    return beyond, ports


def head_pids(head) -> list[int]:
    """The processes of a head started by start_head: its session."""
    import os

    import ray  # noqa: F401

    # isort: split
    import psutil

    pids = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == head.process.pid:
                pids.append(process.pid)
        except OSError:
            continue
    return pids
