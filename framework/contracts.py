"""AsyncAPI 2.x (YAML or JSON) + JSON Schema (draft-07) contracts: loader, registry and lint.

The conventions are Mosaic's own, so one contract means the same to a txbox service and
to a service built with Mosaic's libraries (docs/explanation/receive.md, "Mosaic compatibility"):

- ``x-service-id`` names the service, at the document's top level (where Mosaic's tools
  read it) or under ``info``; else ``info.title`` in lower-kebab-case.
- A channel name is the ``entity.action`` part of a routing key. ``publish`` on a channel
  declares a **command** the service accepts, ``subscribe`` an **event** it emits; on the
  wire both travel with routing key ``<service id>.<channel>`` (the consumer's id for a
  command, the producer's for an event), as Mosaic's message bus sends them.
- Events a service consumes from other services are listed by their wire routing keys
  (``<producer id>.<channel>``, topic patterns allowed) under the top-level
  ``x-subscribes`` list of its own contract.
- A message's type is its ``name``; else the name Mosaic's code generator gives (the
  payload schema's ``title`` in PascalCase without its trailing Command/Event word); else
  its component key in PascalCase. The component key's PascalCase (seed envelopes use it)
  and the generator's name are accepted as aliases of that type when no other message
  claims them: a received alias is stored under the message's one type.
- ``tags: [{name: "aggregate-type:<x>"}]`` gives the aggregate type.
- Versions (docs/explanation/receive.md, "Message versions"): ``x-message-version`` names the
  version ``payload`` describes (the current one, the only schema Mosaic's tools read);
  ``x-previous-versions`` maps each older version a service may still receive to its
  payload schema. A message without them takes any ``message_version``, as Mosaic's own
  libraries do (they send every message as version ``1.1``).

The registry is built once per process; each payload schema is compiled into one
validator that is reused for every message of that type.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import jsonschema_rs
from jsonschema import Draft7Validator
from jsonschema.exceptions import SchemaError
from referencing import Registry as RefRegistry
from referencing import Resource
from referencing.jsonschema import DRAFT7

from framework import contract_files, names
from framework.errors import ContractError, PayloadValidationError, Problem, UnknownMessageType

Kind = Literal["command", "event"]
# A payload schema, its reference validator (the lint), its jsonschema-rs one (payloads), the
# URI its `$ref`s are relative to and every schema file it pulled in (URI → document).
_Compiled = tuple[dict[str, Any], Draft7Validator, Any, str, Mapping[str, Any]]

# Checked with fullmatch: ``$`` would also match before a final newline.
# A channel: words, after Mosaic's tenant and environment placeholders for a multi-tenant
# message (`*.*.image_types.declare`; docs/explanation/receive.md, "Multi-tenant routing keys").
_CHANNEL = re.compile(r"(\*\.\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_BINDING_KEY = re.compile(r"([A-Za-z0-9_-]+|\*|#)(\.([A-Za-z0-9_-]+|\*|#))*")
_IRREGULAR_PAST = frozenset(
    """Done Sent Paid Built Made Held Lost Won Taken Given Begun Run Set Put Cut Read Left Kept Found Sold
    Bought Shown Known Drawn Seen Written Spent Split Shut Hit Quit Froze Frozen Chosen Broken Sung Torn""".split()  # noqa: SIM905
)


# Nouns of an outcome that Mosaic names events with (`EntityPublishSuccess`).
_OUTCOME_NOUNS = frozenset({"Success", "Failure", "Error", "Result"})
_MAX_ROUTING_KEY_BYTES = 255  # AMQP 0-9-1 shortstr


def _is_past_tense(message_type: str) -> bool:
    """Heuristic for the naming lint: does a word of the PascalCase name read as past tense?"""
    words = re.findall(r"[A-Z][a-z0-9]*", message_type)
    return any((w.endswith("ed") and not w.endswith("eed")) or w in _IRREGULAR_PAST for w in words)


def _reads_as_event(message_type: str) -> bool:
    """Past tense, or ends with the noun of an outcome."""
    words = re.findall(r"[A-Z][a-z0-9]*", message_type)
    return _is_past_tense(message_type) or bool(words and words[-1] in _OUTCOME_NOUNS)


@dataclass(frozen=True)
class MessageSpec:
    """What the registry knows about one message type."""

    message_type: str
    kind: Kind
    routing_key: str  # on the wire: `<service>.<channel>`
    service: str  # the owner: the consumer of a command, the producer of an event
    aggregate_type: str
    schema: dict[str, Any] = field(repr=False, compare=False)
    source: str = field(compare=False)  # file and JSON path, for messages to people
    validator: Draft7Validator = field(repr=False, compare=False)
    channel: str = field(default="", compare=False)  # the contract's `entity.action`
    # The version `schema` describes (`x-message-version`); None: the contract names none.
    version: str | None = field(default=None, compare=False)
    # Older version → its spec (`x-previous-versions`); each has its own schema and validator.
    previous: Mapping[str, MessageSpec] = field(default_factory=dict, repr=False, compare=False)
    # The same schema compiled by jsonschema-rs with its linear regex engine: what checks payloads.
    checker: Any = field(default=None, repr=False, compare=False)
    # The channel's `bindings.amqp.queue.name`: where Mosaic's libraries receive it (`<receiver>:<queue>`).
    # txbox receives every message of a service in `<service>:inbox` whatever it says.
    queue: str = field(default=names.MOSAIC_INBOX, compare=False)
    # The URI `schema`'s own `$ref`s are relative to, and every schema file they reach, read
    # and checked at load (URI → document): codegen follows `$ref`s into other files with it.
    schema_uri: str = field(default="", repr=False, compare=False)
    documents: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @cached_property  # asked for every delivery (routes): computed once
    def tenant_scoped(self) -> bool:
        """A multi-tenant message: its routing key holds Mosaic's tenant and environment placeholders."""
        return names.TENANT_PLACEHOLDER in self.routing_key

    def routes(self, key: str) -> bool:
        """Whether ``key`` is this message's routing key, a tenant-scoped one's with any tenant and environment."""
        if self.tenant_scoped:  # the placeholders themselves name no tenant
            return names.placeholders_match(self.routing_key, key)
        return key == self.routing_key

    @property
    def versions(self) -> tuple[str, ...]:
        """Every version the contract declares, the current one first; () when it names none."""
        return (self.version, *self.previous) if self.version is not None else ()

    def at_version(self, version: str | None) -> MessageSpec:
        """The spec whose schema payloads of ``version`` follow (None: the current one).

        A version the contract does not declare raises PayloadValidationError: there is no
        schema to check such a payload against (docs/explanation/receive.md, "Message versions").
        """
        if version is None or self.version is None or version == self.version:
            return self
        older = self.previous.get(version)
        if older is None:
            raise PayloadValidationError(
                self.message_type,
                [f"message_version: {version[:40]!r} is not declared by the contract ({', '.join(self.versions)})"],
            )
        return older

    @property
    def _fast(self) -> Any:
        """The jsonschema-rs validator of this schema (``checker``)."""
        return self.checker

    def validate(self, payload: Any, version: str | None = None) -> None:
        """Raise PayloadValidationError listing the violations (path: message, at most 10).

        ``version`` is the envelope's ``message_version``: the payload is checked against
        that version's schema (None: the current one).

        Only jsonschema-rs, with its linear regex engine, judges and words the errors: a
        contract's `pattern` never runs in a backtracking engine on a sender's data, so a
        check costs bounded time per byte whatever the contract says (docs/explanation/receive.md,
        "Contracts are outside input"). ``validator``, the reference one, lints the schema
        at load and never sees a payload.
        """
        spec = self.at_version(version)
        try:
            if spec.checker.is_valid(payload):
                return
            errors = list(itertools.islice(spec.checker.iter_errors(payload), _MAX_ERRORS))
        except (ValueError, TypeError, OverflowError) as exc:  # a value JSON has no counterpart for
            raise PayloadValidationError(self.message_type, [f"(root): not JSON: {str(exc)[:200]}"]) from None
        errors.sort(key=lambda e: [str(p) for p in e.instance_path])
        raise PayloadValidationError(
            self.message_type,
            [f"{'/'.join(map(str, e.instance_path)) or '(root)'}: {_wording(e.message)}" for e in errors],
        )


@dataclass
class ServiceContract:
    """One service's contract: the messages of every file that names its service id.

    Mosaic splits one service's messages over several files (the media template's media
    and publish documents are both `media-service`); they make one service here too.
    """

    service: str
    path: Path  # the first file (sorted) that names the service
    commands: list[MessageSpec] = field(default_factory=list)  # accepted (publish)
    events: list[MessageSpec] = field(default_factory=list)  # emitted (subscribe)
    subscribes: list[str] = field(default_factory=list)  # consumed event routing keys
    paths: list[Path] = field(default_factory=list)  # every file that names the service
    subscribed_in: dict[str, Path] = field(default_factory=dict)  # x-subscribes key → its file


@dataclass
class Registry:
    """message_type → MessageSpec for every loaded contract, plus per-service views."""

    services: dict[str, ServiceContract] = field(default_factory=dict)
    messages: dict[str, MessageSpec] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # alias → message type
    # alias → message types that would answer to it; settled by _settle_aliases
    alias_claims: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def get(self, message_type: str) -> MessageSpec:
        """The spec of ``message_type`` or of the type it is an alias of."""
        spec = self.messages.get(message_type) or self.messages.get(self.aliases.get(message_type, ""))
        if spec is None:
            raise UnknownMessageType(
                f"unknown message type {message_type!r}: no contract declares it "
                f"(known: {', '.join(sorted(self.messages)) or 'none'})"
            )
        return spec

    def service(self, service: str) -> ServiceContract:
        try:
            return self.services[service]
        except KeyError:
            raise ContractError(
                f"no contract for service {service!r} (found: {', '.join(sorted(self.services)) or 'none'}); "
                f"add one with `x-service-id: {service}` to the contracts folder"
            ) from None

    def binding_keys(self, service: str) -> list[tuple[str, str]]:
        """(exchange, routing key pattern) pairs the service's inbox queue is bound with."""
        contract = self.service(service)
        keys = [(names.COMMAND_EXCHANGE, spec.routing_key) for spec in contract.commands]
        keys += [(names.EVENT_EXCHANGE, key) for key in contract.subscribes]
        return sorted(set(keys))

    def accepted_types(self, service: str) -> list[MessageSpec]:
        """Every message type the service receives: its commands and the events it subscribes to."""
        contract = self.service(service)
        specs = list(contract.commands)
        specs += [
            spec
            for spec in self.messages.values()
            if spec.kind == "event" and any(topic_matches(k, spec.routing_key) for k in contract.subscribes)
        ]
        return specs

    def subscribers(self, spec: MessageSpec) -> list[str]:
        """Services whose inbox receives ``spec`` (reconciliation needs this)."""
        if spec.kind == "command":
            return [s for s, c in self.services.items() if any(m.message_type == spec.message_type for m in c.commands)]
        return [s for s, c in self.services.items() if any(topic_matches(k, spec.routing_key) for k in c.subscribes)]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]


_MAX_ERRORS = 10
_MAX_ERROR_TEXT = 300  # a violation's text quotes the value: a long one is cut


def _wording(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_TEXT else message[:_MAX_ERROR_TEXT] + "..."


def compile_checker(schema: dict[str, Any], files: contract_files.SchemaFiles) -> Any:
    """``schema`` compiled by jsonschema-rs for payload checks; ContractError if it cannot be.

    Its regex engine is the linear one (``RegexOptions``): a pattern that needs
    backtracking (lookaround, backreferences) does not compile, so it is refused here,
    at load, rather than run on a sender's data. ``format`` is an annotation, as for the
    reference validator (so ``format: regex`` compiles nothing a sender wrote).
    """
    try:
        return jsonschema_rs.Draft7Validator(
            schema,
            retriever=files.retrieve,
            pattern_options=jsonschema_rs.RegexOptions(),
            validate_formats=False,
        )
    except ContractError:
        raise
    except Exception as exc:  # jsonschema-rs raises ValidationError, ValueError and others
        text = " ".join(str(exc).split())[:400]
        hint = (
            "; patterns run in a linear-time engine: lookaround, backreferences and possessive or atomic groups "
            "are not supported"
            if "regex" in text
            else ""
        )
        raise ContractError(f"the schema does not compile: {text}{hint}") from None


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: `*` one word, `#` zero or more words."""
    return _topic(pattern.split("."), key.split("."))


def _topic(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_topic(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head in ("*", words[0])) and _topic(rest, words[1:])


def load_registry(contracts_dir: Path | str, *, strict: bool = True) -> Registry:
    """Load every AsyncAPI document (``*.yml``, ``*.yaml``, ``*.json``) under ``contracts_dir``.

    A JSON file that is not an AsyncAPI document is a payload schema and is skipped here.

    With ``strict`` a contract with errors raises ContractError listing them all;
    otherwise the problems are collected in ``registry.problems`` (the lint uses this).
    """
    directory = Path(contracts_dir)
    registry = Registry()
    if not directory.is_dir():
        raise ContractError(
            f"contracts folder {str(directory)!r} does not exist; set TXBOX_CONTRACTS_DIR "
            "(example: TXBOX_CONTRACTS_DIR=contracts)"
        )
    try:
        files = list(contract_files.contract_files(directory))
    except ContractError as exc:
        files = []
        registry.problems.append(Problem("error", str(directory), str(exc)))
    for path in files:
        loader = _Loader(path, directory, registry)
        try:
            loader.load()
        except ContractError as exc:  # the last resort: one bad file is one error, never a crash
            loader.problem("", str(exc))
        except RecursionError:
            loader.problem("", f"nested too deep to load (at most {contract_files.MAX_DEPTH} levels)")
    _lint_cross_file(registry)
    _settle_aliases(registry)
    if strict and registry.errors:
        raise ContractError("contracts do not load:\n" + "\n".join(f"  - {p}" for p in registry.errors))
    return registry


class _Loader:
    def __init__(self, path: Path, root: Path, registry: Registry) -> None:
        self.path = path
        self.root = root
        self.registry = registry
        self.label = str(path)

    def problem(self, where: str, message: str, severity: str = "error") -> None:
        self.registry.problems.append(Problem(severity, f"{self.label}: {where}" if where else self.label, message))

    def read(self) -> dict[str, Any] | None:
        """The AsyncAPI document in the file, or None (a problem is recorded if it is one)."""
        is_json = self.path.suffix == ".json"
        try:
            data = contract_files.read_bytes(self.root, self.path)
        except ContractError as exc:
            self.problem("", str(exc).removeprefix(f"{self.path}: "))
            return None
        try:
            doc = contract_files.parse(data, is_json=is_json, label=self.label)
        except ContractError as exc:
            text = str(exc).removeprefix(f"{self.label}: ")
            if is_json:  # most JSON files are payload schemas; a contract that uses one reports it
                self.problem("", f"{text}, ignored", "warning")
            else:
                self.problem("", f"cannot read YAML: {text}")
            return None
        if not isinstance(doc, dict) or "asyncapi" not in doc:
            if not is_json:
                self.problem("", "not an AsyncAPI document (no `asyncapi` field)")
            return None
        if not str(doc["asyncapi"]).startswith("2."):
            self.problem("asyncapi", f"AsyncAPI {doc['asyncapi']} is not supported; use 2.x")
            return None
        return doc

    def service_id(self, doc: dict[str, Any]) -> str | None:
        """`x-service-id` at the top level or under `info` (they must agree), else the title."""
        info: dict[str, Any] = doc["info"] if isinstance(doc.get("info"), dict) else {}
        top, nested = doc.get("x-service-id"), info.get("x-service-id")
        if top and nested and top != nested:
            self.problem("x-service-id", f"{top!r} differs from info.x-service-id {nested!r}; keep one")
            return None
        title = str(info.get("title", ""))[: names.MAX_NAME * 2]  # bounded before any regex sees it
        service = str(top or nested or names.kebab_case(title))
        if not service:
            self.problem("info", "needs `x-service-id` or `info.title` to name the service")
            return None
        why = names.service_id_problem(service)
        if why is not None:
            self.problem("x-service-id" if top or nested else "info.title", why)
            return None
        return service

    def load(self) -> None:
        doc = self.read()
        if doc is None:
            return
        service = self.service_id(doc)
        if service is None:
            return
        contract = self.registry.services.get(service)
        if contract is None:  # a second file with the same id adds to the service (ServiceContract)
            contract = ServiceContract(service=service, path=self.path)
            self.registry.services[service] = contract
        contract.paths.append(self.path)
        components = doc.get("components") or {}
        components = components.get("messages") if isinstance(components, dict) else None
        if not isinstance(components, dict):
            components = {}
        channels = doc.get("channels") or {}
        if not isinstance(channels, dict):
            self.problem("channels", "must map each channel name to its operations")
            channels = {}
        for channel, item in channels.items():
            self._channel(doc, components, contract, str(channel), item)
        self._subscribes(doc, contract)

    def _channel(
        self, doc: dict[str, Any], components: dict[str, Any], contract: ServiceContract, channel: str, item: Any
    ) -> None:
        """Register the messages of one channel of ``contract``'s document (nothing on a problem)."""
        service = contract.service
        where = f"channels.{channel[:100]!r}" if not _CHANNEL.fullmatch(channel[:300]) else f"channels.{channel}"
        if not self._channel_ok(channel, item, where, service):
            return
        queue = self._queue(item, where, service, "command" if "publish" in item else "event")
        if queue is None:
            return
        operations: tuple[tuple[str, Kind], ...] = (("publish", "command"), ("subscribe", "event"))
        for op, kind in operations:
            if op in item:
                for spec in self._messages(doc, components, item[op], f"{where}.{op}", channel, kind, service):
                    spec = replace(
                        spec, queue=queue, previous={v: replace(p, queue=queue) for v, p in spec.previous.items()}
                    )
                    (contract.commands if kind == "command" else contract.events).append(spec)
                    self._register(spec)

    def _channel_ok(self, channel: str, item: Any, where: str, service: str) -> bool:
        """Whether ``item`` is a channel txbox can route (a problem says why not)."""
        if not isinstance(item, dict):
            self.problem(where, "a channel must be a mapping")
            return False
        if len(channel) > 300 or not _CHANNEL.fullmatch(channel):
            self.problem(
                where,
                "a channel name is the `entity.action` part of a routing key: words of letters, digits, "
                "'_' or '-' separated by '.', after `*.*.` for a multi-tenant message",
            )
            return False
        if len(names.wire_routing_key(service, channel).encode()) > _MAX_ROUTING_KEY_BYTES:
            self.problem(where, f"`<service id>.<channel>` is longer than AMQP's {_MAX_ROUTING_KEY_BYTES} bytes")
            return False
        # Only the whole id, in front of a whole `entity.action`: `channel.published` of
        # `channel`, or Mosaic's own `image_service.enable` of an `image-service`, are
        # channels that merely begin with a word like the id.
        words = channel.split(".")
        if words[0] == service and len(words) >= 3:
            self.problem(
                where,
                f"channel names are `entity.action`: the service id goes in front on the wire, so this "
                f"one travels as {names.wire_routing_key(service, channel)!r}; drop the leading {service!r}",
                "warning",
            )
        return True

    def _subscribes(self, doc: dict[str, Any], contract: ServiceContract) -> None:
        """The document's `x-subscribes`: the routing keys and patterns its service binds."""
        subscribes = doc.get("x-subscribes") or []
        if not isinstance(subscribes, list):
            self.problem("x-subscribes", "must be a list of event routing keys")
            subscribes = []
        for i, key in enumerate(subscribes):
            if not isinstance(key, str) or len(key) > _MAX_ROUTING_KEY_BYTES or not _BINDING_KEY.fullmatch(key):
                self.problem(f"x-subscribes[{i}]", f"{str(key)[:100]!r} is not a routing key or topic pattern")
            else:
                contract.subscribes.append(key)
                contract.subscribed_in.setdefault(key, self.path)

    def _queue(self, item: dict[str, Any], where: str, service: str, kind: Kind) -> str | None:
        """The channel's `bindings.amqp.queue.name` (default `inbox`); None on a problem.

        txbox receives every message of a service in `<service>:inbox`, whatever a channel
        names (docs/explanation/receive.md, "Mosaic compatibility"); another name is a warning
        that says where each side receives the channel's messages.
        """
        bindings = item.get("bindings")
        amqp = bindings.get("amqp") if isinstance(bindings, dict) else None
        queue = amqp.get("queue") if isinstance(amqp, dict) else None
        name = queue.get("name", names.MOSAIC_INBOX) if isinstance(queue, dict) else names.MOSAIC_INBOX
        why = names.queue_name_problem(name)
        if why is not None:
            self.problem(f"{where}.bindings.amqp.queue.name", why)
            return None
        if name != names.MOSAIC_INBOX:
            receiver = "service" if kind == "command" else "subscriber"
            mosaic = names.mosaic_queue(service, name) if kind == "command" else f"<subscriber id>:{name}"
            txbox = names.inbox_queue(service) if kind == "command" else "<subscriber id>:inbox"
            self.problem(
                f"{where}.bindings.amqp.queue.name",
                f"queue {name!r}: Mosaic's libraries receive this {kind} in {mosaic!r}, txbox in {txbox!r}, the one "
                "queue where a txbox service receives all its messages (one receiver keeps each aggregate's "
                "messages in order across types; one dead-letter queue, one delivery limit). Both queues are bound "
                f"to its routing key: with a Mosaic and a txbox build of the {receiver} on one vhost, each message "
                "reaches both and is handled twice. Run one of them, or name the queue `inbox`",
                "warning",
            )
        return name

    def _messages(
        self,
        doc: dict[str, Any],
        components: dict[str, Any],
        operation: Any,
        where: str,
        channel: str,
        kind: Kind,
        service: str,
    ) -> Iterator[MessageSpec]:
        message = operation.get("message") if isinstance(operation, dict) else None
        if message is None:
            self.problem(where, "the operation has no `message`")
            return
        candidates = message["oneOf"] if isinstance(message, dict) and "oneOf" in message else [message]
        if not isinstance(candidates, list):
            self.problem(f"{where}.message.oneOf", "must be a list of messages")
            return
        for i, candidate in enumerate(candidates):
            mwhere = f"{where}.message" + (f".oneOf[{i}]" if len(candidates) > 1 else "")
            key: str | None = None
            if isinstance(candidate, dict) and "$ref" in candidate:
                ref = str(candidate["$ref"])
                prefix = "#/components/messages/"
                if not ref.startswith(prefix) or ref[len(prefix) :] not in components:
                    self.problem(mwhere, f"$ref {ref[:200]!r} does not resolve to a message in components.messages")
                    continue
                key = ref[len(prefix) :]
                candidate = components[key]
                mwhere = f"components.messages.{key}"
            if not isinstance(candidate, dict):
                self.problem(mwhere, "a message must be a mapping")
                continue
            spec = self._spec(candidate, key, mwhere, channel, kind, service)
            if spec is not None:
                yield spec

    def _spec(
        self, msg: dict[str, Any], key: str | None, where: str, channel: str, kind: Kind, service: str
    ) -> MessageSpec | None:
        aggregate = self._aggregate(msg, where, channel)
        if aggregate is None:
            return None
        content_type = msg.get("contentType", "application/json")
        if content_type != "application/json":
            self.problem(f"{where}.contentType", f"{content_type!r}: txbox messages are application/json")
        schema = self._schema(msg.get("payload"), f"{where}.payload")
        if schema is None:
            return None
        schema_doc, validator, checker, schema_uri, documents = schema
        message_type = self._message_type(msg, key, where, schema_doc, kind)
        if message_type is None:
            return None
        versions = self._versions(msg, where)
        if versions is None:
            return None
        version, older = versions
        spec = MessageSpec(
            message_type=message_type,
            kind=kind,
            routing_key=names.wire_routing_key(service, channel),
            service=service,
            aggregate_type=aggregate,
            schema=schema_doc,
            source=f"{self.label}: {where}",
            validator=validator,
            channel=channel,
            version=version,
            checker=checker,
            schema_uri=schema_uri,
            documents=documents,
        )
        previous = {
            old: replace(
                spec,
                schema=s,
                validator=v,
                checker=c,
                source=f"{self.label}: {where}.x-previous-versions.{old}",
                version=old,
                schema_uri=u,
                documents=d,
            )
            for old, (s, v, c, u, d) in older.items()
        }
        return replace(spec, previous=previous)

    def _aggregate(self, msg: dict[str, Any], where: str, channel: str) -> str | None:
        """The message's aggregate type: its `aggregate-type:` tag, else the channel's entity
        word (with a warning); None on a problem."""
        aggregate = None
        tags = msg.get("tags") or []
        for tag in tags if isinstance(tags, list) else []:
            name = str(tag.get("name", "")) if isinstance(tag, dict) else ""
            if name.startswith("aggregate-type:"):
                aggregate = name.split(":", 1)[1].strip()
        if not aggregate:
            # Contracts from before Mosaic required the tag have none: the channel's
            # `entity` word is the aggregate Mosaic's naming puts first.
            entity = channel.removeprefix(f"{names.TENANT_PLACEHOLDER}.{names.TENANT_PLACEHOLDER}.").split(".")[0]
            if names.aggregate_type_problem(entity) is not None:
                self.problem(where, "needs a tag `aggregate-type:<name>`")
                return None
            aggregate = entity
            self.problem(
                where,
                f"no tag `aggregate-type:<name>` (contracts from before Mosaic required it have none): the aggregate "
                f"type is the channel's entity word, {entity!r}; add `tags: [{{name: 'aggregate-type:{entity}'}}]` "
                "to choose it",
                "warning",
            )
        why = names.aggregate_type_problem(aggregate)
        if why is not None:
            self.problem(f"{where}.tags", why)
            return None
        return aggregate

    def _message_type(
        self, msg: dict[str, Any], key: str | None, where: str, schema_doc: dict[str, Any], kind: Kind
    ) -> str | None:
        """The message's type: its `name`, else its payload's `title`, else its component key;
        None on a problem. The other two, when valid, are claimed as its aliases."""
        title = schema_doc.get("title")
        # Bounded before a regex sees them: a longer name is refused below anyway.
        generated = names.mosaic_message_type(title[: names.MAX_NAME * 2]) if isinstance(title, str) else ""
        from_key = names.pascal_case(key[: names.MAX_NAME * 2]) if key else ""
        explicit = msg.get("name")
        if explicit is not None and not (isinstance(explicit, str) and explicit):
            self.problem(
                f"{where}.name", f"{repr(explicit)[:60]} is not a message type: give a PascalCase name or none"
            )
            return None
        message_type: str = explicit or generated or from_key
        if not message_type:
            self.problem(where, "an inline message needs a `name` or a payload schema with a `title`")
            return None
        why = names.message_type_problem(message_type)
        if why is not None:
            origin = "name" if explicit else "payload.title" if generated else "(its component key)"
            self.problem(f"{where}.{origin}" if origin != "(its component key)" else where, why)
            return None
        # An alias that is not a valid message type is not offered: nothing can be sent under it.
        aliases = {a for a in (generated, from_key) if a and names.message_type_problem(a) is None}
        for alias in aliases - {message_type}:
            self.registry.alias_claims.setdefault(alias, []).append(message_type)
        if kind == "event" and not _reads_as_event(message_type):
            self.problem(
                where, f"event {message_type!r} should be named in the past tense (e.g. OrderPlaced)", "warning"
            )
        if kind == "command" and _is_past_tense(message_type):
            self.problem(where, f"command {message_type!r} should be named imperatively (e.g. PlaceOrder)", "warning")
        return message_type

    def _versions(self, msg: dict[str, Any], where: str) -> tuple[str | None, dict[str, _Compiled]] | None:
        """(`x-message-version`, older version → its compiled schema), or None on a problem."""
        version, previous = msg.get("x-message-version"), msg.get("x-previous-versions")
        if version is None:
            if previous is not None:
                self.problem(
                    f"{where}.x-previous-versions",
                    "needs `x-message-version` beside it, the version `payload` describes "
                    '(e.g. x-message-version: "2")',
                )
                return None
            return None, {}
        if not isinstance(version, str) or not version:
            self.problem(
                f"{where}.x-message-version",
                f"{str(version)[:60]!r} is not a version: give it as a string, quoted in YAML "
                '(e.g. x-message-version: "2")',
            )
            return None
        why = names.version_problem(version)
        if why is not None:
            self.problem(f"{where}.x-message-version", why)
            return None
        older = self._older(previous if previous is not None else {}, version, where)
        return None if older is None else (version, older)

    def _older(self, previous: Any, version: str, where: str) -> dict[str, _Compiled] | None:
        """`x-previous-versions` compiled: older version → its schema; None on a problem."""
        if not isinstance(previous, dict):
            self.problem(f"{where}.x-previous-versions", "must map each older version to its payload schema")
            return None
        older: dict[str, _Compiled] = {}
        for old, payload in previous.items():
            vwhere = f"{where}.x-previous-versions.{str(old)[:60]}"
            if not isinstance(old, str) or old == version:
                self.problem(
                    vwhere,
                    f"{str(old)[:60]!r} is not an older version: quote it in YAML, and leave out the current one "
                    f"({version!r}, whose schema is `payload`)",
                )
                return None
            why = names.version_problem(old)
            if why is not None:
                self.problem(f"{where}.x-previous-versions", why)
                return None
            schema = self._schema(payload, vwhere)
            if schema is None:
                return None
            older[old] = schema
        return older

    def _schema(self, payload: Any, where: str) -> _Compiled | None:
        if not isinstance(payload, dict):
            self.problem(where, "needs a payload schema (`$ref` to a JSON Schema file or inline)")
            return None
        files = contract_files.SchemaFiles(self.root)
        found = self._payload(payload, where, files)
        if found is None:
            return None
        schema, uri = found
        label = f"{where} ({uri.removeprefix('file://')})"
        if not self._valid_schema(schema, where, label):
            return None
        registry = self._resolved(schema, uri, files, label)
        if registry is None:
            return None
        # An `$id` makes relative `$ref`s inside the schema resolve against its own file.
        full = {"$id": uri, **schema}
        try:
            checker = compile_checker(full, files)
        except ContractError as exc:
            self.problem(label, str(exc))
            return None
        # The root's URI stands for the schema itself (an inline payload, or a file's fragment),
        # as for both validators above.
        return schema, Draft7Validator(full, registry=registry), checker, uri, {**files.documents, uri: schema}

    def _payload(
        self, payload: dict[str, Any], where: str, files: contract_files.SchemaFiles
    ) -> tuple[Any, str] | None:
        """The payload schema (inline, or the file and fragment its lone `$ref` names) and its
        URI; None on a problem."""
        if "$ref" not in payload or len(payload) != 1:
            return payload, self.path.resolve().as_uri()
        ref = str(payload["$ref"])
        file_part, _, fragment = ref.partition("#")
        try:  # docs/explanation/receive.md, "Contracts are outside input": only files inside the folder
            target = contract_files.ref_target(self.root, self.path.parent, file_part)
            schema = files.load(target, f"$ref {ref[:200]!r}")
        except ContractError as exc:
            self.problem(f"{where}.$ref", str(exc))
            return None
        if fragment:
            schema = _pointer(schema, fragment)
            if schema is None:
                self.problem(f"{where}.$ref", f"{ref[:200]!r}: fragment does not resolve")
                return None
        return schema, target.as_uri()

    def _valid_schema(self, schema: Any, where: str, label: str) -> bool:
        """Whether ``schema`` is a draft-07 schema of an object with valid property names
        (a problem says why not; a schema of another type is only a warning)."""
        if not isinstance(schema, dict):
            self.problem(label, "a payload schema must be a JSON object")
            return False
        for path, why in _schema_names(schema):
            self.problem(f"{where}.payload{path}" if not where.endswith("payload") else f"{where}{path}", why)
            return False
        try:
            Draft7Validator.check_schema(schema)
        except SchemaError as exc:
            path = "/".join(map(str, exc.absolute_path)) or "(root)"
            self.problem(label, f"not a valid draft-07 schema at {path}: {exc.message[:300]}")
            return False
        if schema.get("type") not in (None, "object"):
            self.problem(label, "a payload schema must describe an object")
        return True

    def _resolved(
        self, schema: dict[str, Any], uri: str, files: contract_files.SchemaFiles, label: str
    ) -> RefRegistry | None:
        """A registry in which every `$ref` of ``schema`` resolves; None on a problem."""
        refused: list[ContractError] = []  # why a retrieval failed: referencing words it as the bare URI

        def retrieve(uri: str) -> Resource[Any]:
            try:
                return Resource.from_contents(files.retrieve(uri), default_specification=DRAFT7)
            except ContractError as exc:
                refused.append(exc)
                raise

        registry: RefRegistry = RefRegistry(retrieve=retrieve).with_resource(  # type: ignore[call-arg]
            uri, Resource.from_contents(schema, default_specification=DRAFT7)
        )
        resolver = registry.resolver(base_uri=uri)
        for ref in _all_refs(schema):
            try:
                resolver.lookup(ref)
            except Exception as exc:  # referencing raises several unrelated types
                cause = refused[-1] if refused else exc
                self.problem(label, f"$ref {ref[:200]!r} inside the schema does not resolve: {str(cause)[:800]}")
                return None
        return registry

    def _register(self, spec: MessageSpec) -> None:
        existing = self.registry.messages.get(spec.message_type)
        if existing is not None:
            self.problem(
                spec.source.split(": ", 1)[1],
                f"message type {spec.message_type!r} is also declared at {existing.source}",
            )
            return
        self.registry.messages[spec.message_type] = spec


def _schema_names(schema: Any) -> Iterator[tuple[str, str]]:
    """(JSON path, why) of each property name in ``schema`` that breaks names.property_name_problem.

    Iterative: the document was bounded by contract_files.check_size when it was read.
    """
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for keyword in ("properties", "dependencies"):
            if isinstance(node.get(keyword), dict):
                for key in node[keyword]:
                    why = names.property_name_problem(key)
                    if why is not None:
                        yield f"{path}.{keyword}", why
        if isinstance(node.get("required"), list):
            for key in node["required"]:
                why = names.property_name_problem(key)
                if why is not None:
                    yield f"{path}.required", why
        stack.extend((v, f"{path}.{k}") for k, v in node.items() if isinstance(v, dict | list))


def _pointer(doc: Any, fragment: str) -> Any:
    for part in [p for p in fragment.split("/") if p]:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def _all_refs(schema: Any) -> Iterable[str]:
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _all_refs(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _all_refs(v)


def _lint_cross_file(registry: Registry) -> None:
    seen: dict[tuple[str, str], MessageSpec] = {}
    for spec in registry.messages.values():
        key = (spec.kind, spec.routing_key)
        if key in seen:
            registry.problems.append(
                Problem(
                    "error",
                    spec.source,
                    f"routing key {spec.routing_key!r} is also used by {seen[key].message_type} ({seen[key].source})",
                )
            )
        seen[key] = spec
    for service, contract in registry.services.items():
        for pattern in contract.subscribes:
            if not any(topic_matches(pattern, s.routing_key) for s in registry.messages.values() if s.kind == "event"):
                registry.problems.append(
                    Problem(
                        "warning",
                        f"{contract.subscribed_in.get(pattern, contract.path)}: x-subscribes",
                        f"{service} subscribes to {pattern!r} but no loaded contract emits a matching event",
                    )
                )


def _settle_aliases(registry: Registry) -> None:
    """Keep an alias only when exactly one message claims it and no message is named so.

    An ambiguous alias (two messages share one payload schema, so one generated name) is
    dropped rather than guessed: a message sent under it is an unknown type, as before.
    """
    for alias, claimants in registry.alias_claims.items():
        if alias not in registry.messages and len(set(claimants)) == 1 and claimants[0] in registry.messages:
            registry.aliases[alias] = claimants[0]
