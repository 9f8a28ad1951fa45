package roce

import (
	"fmt"

	"github.com/roce-gather/roce_gather/roce/verbs"
)

func (t *Transport) openVerbs() error {
	d, err := verbs.Open(verbs.Config{HCAs: t.cfg.HCAs, GIDIndex: t.cfg.GIDIndex, Timeout: t.cfg.Timeout})
	if err != nil {
		return fmt.Errorf("verbs fabric: %w", err)
	}
	t.dev, t.kind = d, "verbs"
	return nil
}
