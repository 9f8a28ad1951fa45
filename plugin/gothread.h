/* What a thread of the host process needs before it calls into Go (gothread.c). */
#ifndef RG_PLUGIN_GOTHREAD_H
#define RG_PLUGIN_GOTHREAD_H

/* Gives this thread a signal stack if it has none, before it calls into Go. */
void rg_enter_go(void);

#endif
