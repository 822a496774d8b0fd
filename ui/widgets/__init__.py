"""Reusable widgets: Markdown messages with highlighted code, the thought block, progress delegate, banners."""
