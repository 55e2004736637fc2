"""Daemon-level fuzzing: generated hostile traffic against the real `txbox receiver` and `txbox collector`."""
