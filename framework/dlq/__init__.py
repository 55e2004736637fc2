"""Dead-letter tooling: the collector, queries, replay and discard.

Every message that gave up is one row of ``txbox.dead_letters``. This package reads
those rows (``queries``), drains the broker's ``<service>:dead_letter`` queue into them
(``collector``) and sends them back for processing or closes them (``replay``). The
terminal (``txbox dlq``) and the web dashboard (``framework.dashboard``) are thin views
over these functions.
"""
