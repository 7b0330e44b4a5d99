"""The ``memfit`` command line: one module per subcommand."""
