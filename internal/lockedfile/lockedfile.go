// Package lockedfile opens a file that one process at a time may write: the stats and
// timeline files, which their writer maps and fills in place.
package lockedfile

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// ErrInUse says another process holds the file.
var ErrInUse = errors.New("another process holds it")

// Open opens (creating) path for reading and writing, with an exclusive lock that lives as
// long as the file stays open.
func Open(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, ErrInUse
		}
		return nil, fmt.Errorf("locking it: %w", err)
	}
	return f, nil
}
