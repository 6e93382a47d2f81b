"""Identity of the converted store format, shared by the writer (convert.py) and the reader
(expert_store.py) so that the reader never imports the converter."""

FORMAT_NAME = "colibri-expert-store"  # manifest.json "format"
FORMAT_VERSION = 1  # manifest.json "version"; bump when the layout changes (the reader refuses others)
