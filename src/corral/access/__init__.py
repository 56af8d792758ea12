"""Who may call Corral: principals (a person, a team or an app), their keys and roles.

`principals.py` holds the pure parts (a key's digest, a principal, the ring that finds a
principal by its key); `keyfile.py` the keys `corral keys` keeps in the data directory, which
`corral serve` reads again when they change. The gateway's `ApiKeys` middleware asks the ring
who is calling."""
