"""`txbox new SERVICE`: a service to start from (docs/explanation/development.md, "A new service").

The folder is a Python package: a contract with one command (and the event its handler
publishes), the handler, the service's own tables with an Alembic history beside the
framework's, typed payloads (``txbox codegen``) and tests on the test kit, which pass as
they are.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from pathlib import Path
from string import Template

from framework import codegen, names
from framework.errors import ConfigurationError


@dataclass(frozen=True)
class Names:
    """Every name the scaffold derives from the service id, in one place."""

    service: str  # billing-service
    package: str  # billing_service
    entity: str  # billing: the aggregate type and the first word of the channels
    pascal: str  # Billing
    table: str  # billing

    @classmethod
    def of(cls, service: str, package: str) -> Names:
        if not names.valid_service_id(service):
            raise ConfigurationError(
                f"{service!r} is not a service id: lower-case letters, digits, '-' or '_' (example: billing-service)"
            )
        if not package.isidentifier() or keyword.iskeyword(package):
            raise ConfigurationError(
                f"the folder {package!r} cannot be a Python package (the tests import it): name it like billing_service"
            )
        entity = service.removesuffix("-service").removesuffix("_service") or service
        snake = entity.replace("-", "_")
        if not snake.isidentifier():  # starts with a digit, say
            snake = f"item_{snake}"
        return cls(service, package, snake.replace("_", "-"), names.pascal_case(snake), snake)

    def substitutions(self) -> dict[str, str]:
        return {
            "service": self.service,
            "package": self.package,
            "entity": self.entity,
            "Entity": self.pascal,
            "table": self.table,
            "title": self.service.replace("-", " ").replace("_", " ").title(),
        }


def create(folder: Path, service: str) -> list[Path]:
    """Write the scaffold into ``folder`` (new or empty), a package named as the folder; the files written."""
    chosen = Names.of(service, folder.name)
    if folder.exists() and any(folder.iterdir()):
        raise ConfigurationError(
            f"{folder} exists and is not empty: choose a new folder (txbox new SERVICE --dir PATH)"
        )
    values = chosen.substitutions()
    written: list[Path] = []
    for relative, text in FILES.items():
        path = folder / Template(relative).substitute(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(text).substitute(values), encoding="utf-8")
        written.append(path)
    messages = folder / "messages.py"
    codegen.write(messages, folder / "contracts", [chosen.service])
    written.append(messages)
    return written


FILES: dict[str, str] = {
    "__init__.py": '''\
"""$service: a txbox service (scaffolded by `txbox new`)."""
''',
    "contracts/$service/$service.yml": """\
asyncapi: 2.0.0
# The service id: the first word of every routing key of the service.
x-service-id: $service
info:
  title: $title
  version: '0.1.0'
  description: |
    Accepts Create$Entity commands and publishes ${Entity}Created events.
channels:
  '$entity.create':
    publish:
      message:
        $$ref: '#/components/messages/create-$entity'
  '$entity.created':
    subscribe:
      message:
        $$ref: '#/components/messages/$entity-created'
components:
  messages:
    create-$entity:
      name: Create$Entity
      tags:
        - name: aggregate-type:$entity
      contentType: application/json
      payload:
        $$ref: 'commands/create-$entity.json'
    $entity-created:
      name: ${Entity}Created
      tags:
        - name: aggregate-type:$entity
      contentType: application/json
      payload:
        $$ref: 'events/$entity-created.json'
""",
    "contracts/$service/commands/create-$entity.json": """\
{
  "$$schema": "http://json-schema.org/draft-07/schema#",
  "type": "object",
  "title": "create_${table}_command",
  "description": "Create one $entity.",
  "additionalProperties": false,
  "required": ["name"],
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 200}
  }
}
""",
    "contracts/$service/events/$entity-created.json": """\
{
  "$$schema": "http://json-schema.org/draft-07/schema#",
  "type": "object",
  "title": "${table}_created_event",
  "description": "A $entity was created.",
  "additionalProperties": false,
  "required": ["id", "name"],
  "properties": {
    "id": {"type": "string"},
    "name": {"type": "string"}
  }
}
""",
    "app.py": '''\
"""$service: its Service and handlers.

Run its daemons with `txbox run --app $package.app:service` (TXBOX_DATABASE_URL and
TXBOX_AMQP_URL say where); migrate its database with `txbox migrate --app $package.app:service`
and `alembic -c $package/alembic.ini upgrade head`.
"""

from __future__ import annotations

import os
from pathlib import Path

from framework import CommandHandler, Message, Outbox, PermanentError, Service
from sqlalchemy import bindparam
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from $package import messages
from $package.models import $Entity

HERE = Path(__file__).resolve().parent

service = Service.from_env(
    service="$service",
    database_url=os.environ.get("TXBOX_DATABASE_URL") or "postgresql+psycopg://postgres@127.0.0.1:5432/$package",
    contracts_dir=os.environ.get("TXBOX_CONTRACTS_DIR") or str(HERE / "contracts"),
)

_${table} = $Entity.metadata.tables[$Entity.__tablename__]
_CREATE = (
    insert(_${table})
    .values(id=bindparam("id_"), name=bindparam("name_"))
    .on_conflict_do_nothing(index_elements=[_${table}.c.id])
    .returning(_${table}.c.id)
)


class Create$Entity(CommandHandler):
    """Runs in the worker's transaction: the row, the event and the message's processed mark commit together."""

    message_type = "Create$Entity"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        command = message.payload_as(messages.Create$Entity)  # typed by `txbox codegen`
        created = session.scalar(_CREATE, {"id_": message.aggregate_id, "name_": command["name"]})
        if created is None:
            raise PermanentError(f"$entity {message.aggregate_id} exists already")
        outbox.publish_event(
            "${Entity}Created",
            aggregate_id=message.aggregate_id,
            payload=messages.${Entity}Created(id=message.aggregate_id, name=command["name"]),
        )


service.register(Create$Entity())
''',
    "models.py": '''\
"""$service's own tables, beside the framework's (schema txbox); their Alembic history is migrations/."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class $Entity(Base):
    __tablename__ = "$table"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=text("clock_timestamp()"))
''',
    "alembic.ini": """\
# $service's own Alembic history (its tables; version table public.alembic_version),
# beside the framework's (`txbox migrate`; version table txbox.txbox_alembic_version).
# TXBOX_DATABASE_URL names the database when sqlalchemy.url is not set here.
[alembic]
script_location = %(here)s/migrations
""",
    "migrations/__init__.py": "",
    "migrations/env.py": '''\
"""Alembic environment of $service's own tables."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from $package.models import Base

url = context.config.get_main_option("sqlalchemy.url") or os.environ.get("TXBOX_DATABASE_URL")
if not url:
    raise SystemExit("set TXBOX_DATABASE_URL (or sqlalchemy.url in alembic.ini) to the service's database")
if context.is_offline_mode():
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=Base.metadata)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()
''',
    "migrations/script.py.mako": '''\
"""$${message}

Revision ID: $${up_revision}
Revises: $${down_revision | comma,n}
Create Date: $${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
$${imports if imports else ""}
revision = $${repr(up_revision)}
down_revision = $${repr(down_revision)}
branch_labels = $${repr(branch_labels)}
depends_on = $${repr(depends_on)}


def upgrade() -> None:
    $${upgrades if upgrades else "pass"}


def downgrade() -> None:
    $${downgrades if downgrades else "pass"}
''',
    "migrations/versions/__init__.py": "",
    "migrations/versions/${table}_0001.py": '''\
"""$table table

Revision ID: ${table}_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "${table}_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "$table",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")
        ),
    )


def downgrade() -> None:
    op.drop_table("$table")
''',
    "tests/__init__.py": "",
    "tests/test_handlers.py": '''\
"""$service's handlers against a database of the test's own (no broker, no daemons).

`txbox_database` (a fixture of txbox's pytest plugin) clones a template migrated once per
run with the framework's history and this service's own (alembic.ini).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from framework import PermanentError
from framework.testing import Harness
from sqlalchemy import select

from $package import messages
from $package.app import service
from $package.models import $Entity

ALEMBIC = Path(__file__).resolve().parents[1] / "alembic.ini"


@pytest.fixture
def harness(txbox_database: Callable[..., str]) -> Iterator[Harness]:
    with Harness(service, database_url=txbox_database(ALEMBIC)) as harness:
        yield harness


def test_create_stores_the_${table}_and_publishes_${table}_created(harness: Harness) -> None:
    done = harness.deliver("Create$Entity", aggregate_id="1", payload=messages.Create$Entity(name="first"))

    with harness.engine().connect() as conn:
        assert conn.scalar(select($Entity.name).where($Entity.id == "1")) == "first"
    [created] = done.sent
    assert created.message_type == "${Entity}Created"
    assert created.payload == {"id": "1", "name": "first"}


def test_creating_it_twice_is_a_permanent_error(harness: Harness) -> None:
    harness.deliver("Create$Entity", aggregate_id="1", payload=messages.Create$Entity(name="first"))
    with pytest.raises(PermanentError, match="exists already"):
        harness.deliver("Create$Entity", aggregate_id="1", payload=messages.Create$Entity(name="again"))
''',
}
