"""The plugin host: entry-point loading, the built-in registrations and the recipe checks that need them.
The top floor below the CLI: only ``stitch.cli`` imports it and hands what it resolves down."""
