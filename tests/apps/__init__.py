"""Test services (Service + handlers) started by tests through `txbox ... --app tests.apps.<name>:service`."""
