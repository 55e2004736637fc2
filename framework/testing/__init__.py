"""Test what you build on txbox without a broker or daemons (docs/explanation/development.md, "Testing handlers").

- :class:`Harness`: deliver a message to a service's handler against a real (test)
  database, admitted as the receiver admits it and run as the worker runs it; get back
  what the handler sent, and route that on to other registered services until idle.
- pytest fixtures (``framework.testing.pytest_plugin``, loaded automatically):
  ``txbox_database`` gives each test a migrated database cloned from a template.
- :func:`wait_until_processed`: for tests that do run the daemons.
"""

from framework.errors import DeliveryRejected, NotProcessed
from framework.testing.harness import Delivered, Harness
from framework.testing.wait import wait_until_processed

__all__ = ["Delivered", "DeliveryRejected", "Harness", "NotProcessed", "wait_until_processed"]
