"""AsyncAPI 2.x (YAML or JSON) + JSON Schema (draft-07) contracts: loader, registry and lint.

The conventions are Mosaic's own, so one contract means the same to a txbox service and
to a service built with Mosaic's libraries (docs/architecture.md, "Mosaic compatibility"):

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
- Versions (docs/architecture.md, "Message versions"): ``x-message-version`` names the
  version ``payload`` describes (the current one, the only schema Mosaic's tools read);
  ``x-previous-versions`` maps each older version a service may still receive to its
  payload schema. A message without them takes any ``message_version``, as Mosaic's own
  libraries do (they send every message as version ``1.1``).

The registry is built once per process; each payload schema is compiled into one
validator that is reused for every message of that type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import jsonschema_rs
import yaml
from jsonschema import Draft7Validator
from jsonschema.exceptions import SchemaError
from referencing import Registry as RefRegistry
from referencing import Resource
from referencing.jsonschema import DRAFT7

from framework import names
from framework.errors import ContractError, PayloadValidationError, Problem, UnknownMessageType

Kind = Literal["command", "event"]

# Checked with fullmatch: ``$`` would also match before a final newline.
_ROUTING_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_BINDING_KEY = re.compile(r"([A-Za-z0-9_-]+|\*|#)(\.([A-Za-z0-9_-]+|\*|#))*")
_IRREGULAR_PAST = frozenset(
    """Done Sent Paid Built Made Held Lost Won Taken Given Begun Run Set Put Cut Read Left Kept Found Sold
    Bought Shown Known Drawn Seen Written Spent Split Shut Hit Quit Froze Frozen Chosen Broken Sung Torn""".split()  # noqa: SIM905
)


# Nouns of an outcome that Mosaic names events with (`EntityPublishSuccess`).
_OUTCOME_NOUNS = frozenset({"Success", "Failure", "Error", "Result"})
_CONTRACT_SUFFIXES = (".yml", ".yaml", ".json")
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

    @property
    def versions(self) -> tuple[str, ...]:
        """Every version the contract declares, the current one first; () when it names none."""
        return (self.version, *self.previous) if self.version is not None else ()

    def at_version(self, version: str | None) -> MessageSpec:
        """The spec whose schema payloads of ``version`` follow (None: the current one).

        A version the contract does not declare raises PayloadValidationError: there is no
        schema to check such a payload against (docs/architecture.md, "Message versions").
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

    @cached_property
    def _fast(self) -> Any:
        """The same schema compiled by jsonschema-rs, or None if it cannot take it.

        ``validator`` (the reference ``jsonschema`` one) costs ~40 µs per small payload
        here — more than the rest of an outbox write or a receiver's work per message;
        jsonschema-rs checks the same draft-07 schema in ~1 µs.
        """
        try:
            return jsonschema_rs.Draft7Validator(self.validator.schema, retriever=_retrieve_json)
        except Exception:  # a schema it cannot compile: the reference validator does it all
            return None

    def validate(self, payload: Any, version: str | None = None) -> None:
        """Raise PayloadValidationError listing every violation (path: message).

        ``version`` is the envelope's ``message_version``: the payload is checked against
        that version's schema (None: the current one).

        jsonschema-rs answers first; a payload it does not accept (or cannot read) goes to
        the reference validator, which words the errors and has the last word.
        """
        spec = self.at_version(version)
        fast = spec._fast
        if fast is not None:
            with suppress(Exception):  # e.g. a value that is not JSON: let the reference judge
                if fast.is_valid(payload):
                    return
        errors = sorted(spec.validator.iter_errors(payload), key=lambda e: list(e.absolute_path))
        if errors:
            raise PayloadValidationError(
                self.message_type,
                [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors[:10]],
            )


@dataclass
class ServiceContract:
    """One service's contract file."""

    service: str
    path: Path
    commands: list[MessageSpec] = field(default_factory=list)  # accepted (publish)
    events: list[MessageSpec] = field(default_factory=list)  # emitted (subscribe)
    subscribes: list[str] = field(default_factory=list)  # consumed event routing keys


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
    files = sorted(p for p in directory.rglob("*") if p.suffix in _CONTRACT_SUFFIXES and p.is_file())
    for path in files:
        _Loader(path, directory, registry).load()
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
            text = self.path.read_text(encoding="utf-8")
            doc = json.loads(text) if is_json else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            if is_json:  # most JSON files are payload schemas; a contract that uses one reports it
                self.problem("", f"not valid JSON, ignored: {exc}", "warning")
            else:
                self.problem("", f"cannot read YAML: {exc}")
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
        service = str(top or nested or names.kebab_case(str(info.get("title", ""))))
        if not service:
            self.problem("info", "needs `x-service-id` or `info.title` to name the service")
            return None
        if not names.valid_service_id(service):
            self.problem(
                "x-service-id",
                f"{service!r} is not a service id: lower-case letters, digits, '-' or '_' "
                "(it is the first word of every routing key of the service)",
            )
            return None
        if service in self.registry.services:
            other = self.registry.services[service].path
            self.problem("x-service-id", f"service {service!r} is also defined in {other}")
            return None
        return service

    def load(self) -> None:
        doc = self.read()
        if doc is None:
            return
        service = self.service_id(doc)
        if service is None:
            return
        contract = ServiceContract(service=service, path=self.path)
        self.registry.services[service] = contract
        components = (doc.get("components") or {}).get("messages") or {}
        for channel, item in (doc.get("channels") or {}).items():
            where = f"channels.{channel}"
            if not isinstance(item, dict):
                self.problem(where, "a channel must be a mapping")
                continue
            channel = str(channel)
            if not _ROUTING_KEY.fullmatch(channel):
                self.problem(
                    where,
                    "a channel name is the `entity.action` part of a routing key: words of letters, digits, "
                    "'_' or '-' separated by '.'",
                )
                continue
            if len(names.wire_routing_key(service, channel).encode()) > _MAX_ROUTING_KEY_BYTES:
                self.problem(where, f"`<service id>.<channel>` is longer than AMQP's {_MAX_ROUTING_KEY_BYTES} bytes")
                continue
            if channel.split(".")[0] in (service, service.replace("-", "_")):
                self.problem(
                    where,
                    f"channel names are `entity.action`: the service id goes in front on the wire, so this "
                    f"one travels as {names.wire_routing_key(service, channel)!r}; drop the leading {service!r}",
                    "warning",
                )
            operations: tuple[tuple[str, Kind], ...] = (("publish", "command"), ("subscribe", "event"))
            for op, kind in operations:
                if op in item:
                    for spec in self._messages(doc, components, item[op], f"{where}.{op}", channel, kind, service):
                        (contract.commands if kind == "command" else contract.events).append(spec)
                        self._register(spec)
        subscribes = doc.get("x-subscribes") or []
        if not isinstance(subscribes, list):
            self.problem("x-subscribes", "must be a list of event routing keys")
            subscribes = []
        for i, key in enumerate(subscribes):
            if not isinstance(key, str) or not _BINDING_KEY.fullmatch(key):
                self.problem(f"x-subscribes[{i}]", f"{key!r} is not a routing key or topic pattern")
            else:
                contract.subscribes.append(key)

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
        for i, candidate in enumerate(candidates):
            mwhere = f"{where}.message" + (f".oneOf[{i}]" if len(candidates) > 1 else "")
            key: str | None = None
            if isinstance(candidate, dict) and "$ref" in candidate:
                ref = str(candidate["$ref"])
                prefix = "#/components/messages/"
                if not ref.startswith(prefix) or ref[len(prefix) :] not in components:
                    self.problem(mwhere, f"$ref {ref!r} does not resolve to a message in components.messages")
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
        aggregate = None
        for tag in msg.get("tags") or []:
            name = str((tag or {}).get("name", ""))
            if name.startswith("aggregate-type:"):
                aggregate = name.split(":", 1)[1].strip()
        if not aggregate:
            self.problem(where, "needs a tag `aggregate-type:<name>`")
            return None
        content_type = msg.get("contentType", "application/json")
        if content_type != "application/json":
            self.problem(f"{where}.contentType", f"{content_type!r}: txbox messages are application/json")
        schema = self._schema(msg.get("payload"), f"{where}.payload")
        if schema is None:
            return None
        schema_doc, validator = schema
        title = schema_doc.get("title")
        generated = names.mosaic_message_type(title) if isinstance(title, str) else ""
        from_key = names.pascal_case(key) if key else ""
        explicit = msg.get("name")
        if explicit is not None and not (isinstance(explicit, str) and explicit):
            self.problem(f"{where}.name", f"{explicit!r} is not a message type: give a PascalCase name or none")
            return None
        message_type = explicit or generated or from_key
        if not message_type:
            self.problem(where, "an inline message needs a `name` or a payload schema with a `title`")
            return None
        for alias in {generated, from_key} - {"", message_type}:
            self.registry.alias_claims.setdefault(alias, []).append(message_type)
        if kind == "event" and not _reads_as_event(message_type):
            self.problem(
                where, f"event {message_type!r} should be named in the past tense (e.g. OrderPlaced)", "warning"
            )
        if kind == "command" and _is_past_tense(message_type):
            self.problem(where, f"command {message_type!r} should be named imperatively (e.g. PlaceOrder)", "warning")
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
        )
        previous = {
            old: replace(
                spec, schema=s, validator=v, source=f"{self.label}: {where}.x-previous-versions.{old}", version=old
            )
            for old, (s, v) in older.items()
        }
        return replace(spec, previous=previous)

    def _versions(
        self, msg: dict[str, Any], where: str
    ) -> tuple[str | None, dict[str, tuple[dict[str, Any], Draft7Validator]]] | None:
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
                f'{version!r} is not a version: give it as a string, quoted in YAML (e.g. x-message-version: "2")',
            )
            return None
        if previous is None:
            previous = {}
        if not isinstance(previous, dict):
            self.problem(f"{where}.x-previous-versions", "must map each older version to its payload schema")
            return None
        older: dict[str, tuple[dict[str, Any], Draft7Validator]] = {}
        for old, payload in previous.items():
            vwhere = f"{where}.x-previous-versions.{old}"
            if not isinstance(old, str) or old == version:
                self.problem(
                    vwhere,
                    f"{old!r} is not an older version: quote it in YAML, and leave out the current one "
                    f"({version!r}, whose schema is `payload`)",
                )
                return None
            schema = self._schema(payload, vwhere)
            if schema is None:
                return None
            older[old] = schema
        return version, older

    def _schema(self, payload: Any, where: str) -> tuple[dict[str, Any], Draft7Validator] | None:
        if not isinstance(payload, dict):
            self.problem(where, "needs a payload schema (`$ref` to a JSON Schema file or inline)")
            return None
        base = self.path.parent
        if "$ref" in payload and len(payload) == 1:
            ref = str(payload["$ref"])
            file_part, _, fragment = ref.partition("#")
            target = (base / file_part).resolve()
            if not target.is_file():
                self.problem(f"{where}.$ref", f"{ref!r} does not resolve: no file {target}")
                return None
            try:
                schema = json.loads(target.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                self.problem(f"{where}.$ref", f"{ref!r} is not valid JSON: {exc}")
                return None
            if fragment:
                schema = _pointer(schema, fragment)
                if schema is None:
                    self.problem(f"{where}.$ref", f"{ref!r}: fragment does not resolve")
                    return None
            uri = target.as_uri()
        else:
            schema = payload
            uri = self.path.resolve().as_uri()
        label = f"{where} ({uri.removeprefix('file://')})"
        try:
            Draft7Validator.check_schema(schema)
        except SchemaError as exc:
            path = "/".join(map(str, exc.absolute_path)) or "(root)"
            self.problem(label, f"not a valid draft-07 schema at {path}: {exc.message}")
            return None
        if schema.get("type") not in (None, "object"):
            self.problem(label, "a payload schema must describe an object")
        registry: RefRegistry = RefRegistry(retrieve=_retrieve_file).with_resource(  # type: ignore[call-arg]
            uri, Resource.from_contents(schema, default_specification=DRAFT7)
        )
        resolver = registry.resolver(base_uri=uri)
        for ref in _all_refs(schema):
            try:
                resolver.lookup(ref)
            except Exception as exc:  # referencing raises several unrelated types
                self.problem(label, f"$ref {ref!r} inside the schema does not resolve: {exc}")
                return None
        # An `$id` makes relative `$ref`s inside the schema resolve against its own file.
        return schema, Draft7Validator({"$id": uri, **schema}, registry=registry)

    def _register(self, spec: MessageSpec) -> None:
        existing = self.registry.messages.get(spec.message_type)
        if existing is not None:
            self.problem(
                spec.source.split(": ", 1)[1],
                f"message type {spec.message_type!r} is also declared at {existing.source}",
            )
            return
        self.registry.messages[spec.message_type] = spec


def _retrieve_json(uri: str) -> Any:
    if not uri.startswith("file://"):
        raise ContractError(f"only local file references are allowed in schemas, not {uri}")
    return json.loads(Path(uri.removeprefix("file://")).read_text(encoding="utf-8"))


def _retrieve_file(uri: str) -> Resource[Any]:
    return Resource.from_contents(_retrieve_json(uri), default_specification=DRAFT7)


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
                        f"{contract.path}: x-subscribes",
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
