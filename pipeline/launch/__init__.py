"""Starting a whole box: `plan` turns launcher options into one command line
per stage (pure, no processes); `supervisor` runs them, waits for the proxy's
/health, restarts stages that die, and stops everything cleanly. The command
is bin/epd-launch."""
