"""The web dashboard: per-service health, dead-letter groups, list, detail, replay/discard.

Server-rendered (Starlette + Jinja2, charts as inline SVG drawn here), no JavaScript, a
JSON API mirroring every page. See :mod:`framework.dashboard.app`.
"""
