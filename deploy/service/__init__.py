"""`tandem` as a service: the launchd LaunchAgent (macOS) and the systemd user
unit (Linux) that run `tandem serve`, the one seam through which launchctl,
systemctl and journalctl are called, and the listening socket the supervisor
keeps (or is handed by launchd or systemd) across router restarts."""
