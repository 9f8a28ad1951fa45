// Package lockedfile makes a file that one process at a time may write: the stats and
// timeline files, which their writer maps and fills in place.
package lockedfile

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// ErrInUse says another process holds the file.
var ErrInUse = errors.New("another process holds it (put %p in the path for one file a process)")

// Create opens (creating) path for reading and writing, with an exclusive lock that lives
// as long as the file stays open, and makes contents the whole file.
func Create(path string, contents []byte) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); errors.Is(err, syscall.EWOULDBLOCK) {
		err = ErrInUse
	} else if err != nil {
		err = fmt.Errorf("locking it: %w", err)
	} else if err = f.Truncate(0); err == nil {
		_, err = f.WriteAt(contents, 0)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
