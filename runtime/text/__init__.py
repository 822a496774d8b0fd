"""The text layer: tokenizer and streaming detokenizer, chat templates, output parsers."""
