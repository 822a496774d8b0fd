"""Application services: settings, library, downloads, worker client, CLI. Qt only through QtCore/QtNetwork."""
