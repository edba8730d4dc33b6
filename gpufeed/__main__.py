from gpufeed.convert.cli import entry

entry()
