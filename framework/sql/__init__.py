"""The SQL of txbox, one module per table: its statements and its one row codec.

``outbox``, ``inbox``, ``dead_letters`` and ``redeliveries``; ``messages`` and
``pending`` for statements that serve the outbox and the inbox alike, ``retention`` for
the pruners' pages of both; ``reports`` for
the report tables of ``txbox analyze``. Every writer of a table goes through that
table's one INSERT, and claimed rows are read by column name. The SQLAlchemy metadata
the migrations are checked against stays in framework/tables.py (docs/architecture.md,
"Tables and their SQL").
"""
