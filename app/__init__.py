"""Application services: settings, library, downloads, worker client, CLI. No QtWidgets here."""
