from gpufeed.cli import entry

entry()
