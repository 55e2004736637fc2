"""The inbox queues' delivery limit, applied as a RabbitMQ policy through the management API.

The limit is the last net under the receiver (docs/explanation/receive.md, "Receiver intake"):
a message delivered ``INBOX_DELIVERY_LIMIT`` times without an ack is dead-lettered by
RabbitMQ into ``<service>:dead_letter`` and stored by the collector. It must be a policy,
not a queue argument (Mosaic services declare the inbox queues without one), and on
RabbitMQ 3.x nothing applies a policy unless someone does: ``txbox topology`` and the
receiver put it through the management HTTP API (the ``rabbitmq_management`` plugin) and,
when that is not reachable or not allowed, say the exact ``rabbitmqctl`` line to run.

A policy already in force on the inbox queue wins: RabbitMQ applies one policy per queue,
so ours (priority 0) never displaces an operator's; when theirs sets no delivery limit,
the message says to add it there.
"""

from __future__ import annotations

import base64
import json
import shlex
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import pika

from framework import names
from framework.errors import ConfigurationError
from framework.settings import Settings, mask_url

# Well above the receiver's own redelivery counter: RabbitMQ also counts the returns of
# messages that were only prefetched when a receiver stopped. RabbitMQ 4 gives quorum
# queues a delivery limit of 20 by default.
INBOX_DELIVERY_LIMIT = 20
TIMEOUT_SECONDS = 5.0
# The management API's default port beside AMQP's default port. A broker on other ports
# has its management API who knows where: it must be configured, never guessed (a guess
# could reach another broker on the same host).
MANAGEMENT_PORTS = {5672: ("http", 15672), 5671: ("https", 15671)}


@dataclass(frozen=True)
class Outcome:
    """What :func:`ensure` found: ``held`` is True when the inbox queues have a delivery limit."""

    held: bool
    message: str


def policy_definition() -> dict[str, Any]:
    return {
        "pattern": names.INBOX_QUEUE_PATTERN,
        "definition": {"delivery-limit": INBOX_DELIVERY_LIMIT},
        "apply-to": "queues",
        "priority": 0,
    }


def policy_command(vhost: str) -> str:
    """The line an operator runs once per vhost when txbox cannot apply the policy itself."""
    definition = json.dumps(policy_definition()["definition"])
    return (
        f"rabbitmqctl set_policy -p {shlex.quote(vhost)} --apply-to queues --priority 0 {names.INBOX_LIMIT_POLICY} "
        f"'{names.INBOX_QUEUE_PATTERN}' '{definition}'"
    )


@dataclass(frozen=True)
class Management:
    """Where the management API is and how to log in; derived from the AMQP URL unless configured."""

    base_url: str  # ".../api", no credentials
    username: str
    password: str
    vhost: str

    @classmethod
    def from_settings(cls, settings: Settings) -> Management | None:
        """None when TXBOX_AMQP_MANAGEMENT_URL=off (the operator manages policies)."""
        configured = (settings.amqp_management_url or "").strip()
        if configured.lower() == "off":
            return None
        first = settings.amqp_url.split(",", maxsplit=1)[0].strip()
        try:
            amqp = pika.URLParameters(first)
        except Exception as exc:  # pika raises assorted types for bad URLs
            raise ConfigurationError(f"TXBOX_AMQP_URL={mask_url(first)!r} is not valid ({exc})") from None
        credentials = amqp.credentials
        username = getattr(credentials, "username", "guest")
        password = getattr(credentials, "password", "guest")
        if not configured:
            if amqp.port not in MANAGEMENT_PORTS:
                raise ConfigurationError(
                    f"RabbitMQ listens on port {amqp.port}, not a default port, so where its management API is "
                    "cannot be derived: set TXBOX_AMQP_MANAGEMENT_URL (e.g. http://127.0.0.1:15672/api, or off)"
                )
            scheme, port = MANAGEMENT_PORTS[amqp.port]
            host = f"[{amqp.host}]" if ":" in amqp.host else amqp.host
            return cls(f"{scheme}://{host}:{port}/api", username, password, amqp.virtual_host)
        parts = urllib.parse.urlsplit(configured)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"TXBOX_AMQP_MANAGEMENT_URL={mask_url(configured)!r} is not an http(s) URL of the RabbitMQ "
                "management API. Example: TXBOX_AMQP_MANAGEMENT_URL=http://127.0.0.1:15672/api (or off)"
            )
        netloc = parts.netloc.rsplit("@", maxsplit=1)[-1]
        base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        if parts.username is not None:
            username = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
        return cls(base, username, password, amqp.virtual_host)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One call; None for 404. Raises urllib/OSError on anything else that went wrong."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS) as response:
                payload = response.read(1 << 20)  # a policy or a queue's facts: small
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return json.loads(payload) if payload.strip() else None

    def path(self, kind: str, name: str) -> str:
        return f"/{kind}/{urllib.parse.quote(self.vhost, safe='')}/{urllib.parse.quote(name, safe='')}"


def ensure(settings: Settings) -> Outcome:
    """Give the vhost's inbox queues the delivery limit, unless they have one. Never raises."""
    if settings.queue_type != "quorum":
        return Outcome(
            False,
            "classic inbox queues have no delivery limit: the receiver's redelivery counter "
            "(TXBOX_RECEIVER_REDELIVERY_LIMIT) is the only net",
        )
    try:
        management = Management.from_settings(settings)
    except ConfigurationError as exc:
        return Outcome(False, f"{exc}; or run once: {policy_command('/')}")
    if management is None:
        return Outcome(True, "TXBOX_AMQP_MANAGEMENT_URL=off: the delivery-limit policy is left to the operator")
    command = policy_command(management.vhost)
    try:
        return _ensure(management, names.inbox_queue(settings.service))
    except (OSError, ValueError) as exc:  # unreachable, refused (401/403: no policymaker tag), not JSON
        why = f"HTTP {exc.code} {exc.reason}" if isinstance(exc, urllib.error.HTTPError) else repr(exc)
        return Outcome(
            False,
            f"could not apply the inbox delivery-limit policy through the RabbitMQ management API at "
            f"{management.base_url} ({why}); without it a message that kills every receiver is redelivered "
            f"forever on RabbitMQ 3.x. Fix: enable rabbitmq_management and give the user the policymaker tag "
            f"(or set TXBOX_AMQP_MANAGEMENT_URL), or run once: {command}",
        )


def _ensure(management: Management, inbox: str) -> Outcome:
    queue = management.request("GET", management.path("queues", inbox)) or {}
    in_force = queue.get("policy") or None
    effective = queue.get("effective_policy_definition") or {}
    if isinstance(effective, dict) and "delivery-limit" in effective:
        return Outcome(True, f"{inbox} has delivery-limit {effective['delivery-limit']} (policy {in_force})")
    if in_force and in_force != names.INBOX_LIMIT_POLICY:
        return Outcome(
            False,
            f"policy {in_force!r} applies to {inbox} and sets no delivery-limit; RabbitMQ applies one policy "
            f'per queue, so add "delivery-limit": {INBOX_DELIVERY_LIMIT} to its definition',
        )
    wanted, path = policy_definition(), management.path("policies", names.INBOX_LIMIT_POLICY)
    current = management.request("GET", path)
    verb = "has"
    if not (current and all(current.get(k) == v for k, v in wanted.items())):
        management.request("PUT", path, wanted)
        verb = "now has"
    return Outcome(True, f"{inbox} {verb} delivery-limit {INBOX_DELIVERY_LIMIT} (policy {names.INBOX_LIMIT_POLICY})")
