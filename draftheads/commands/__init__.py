"""The ``draftheads`` subcommands: argument parsing and printing over the library, one module each."""
