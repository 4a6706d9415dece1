/* The pod sandbox's pause process: holds the pod's namespaces, reaps orphaned children (it is PID 1
 * of the pod when the PID namespace is shared) and exits on SIGINT/SIGTERM. Built statically
 * (images/build.py) into an image of its own, which the kubelet's containerd uses as sandbox image.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("rlhf-pause 1.0");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: warning: not PID 1\n");
    }
    struct sigaction stop = {0};
    stop.sa_handler = on_stop;
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0) {
        return 1;
    }
    struct sigaction child = {0};
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGCHLD, &child, NULL) < 0) {
        return 2;
    }
    for (;;) {
        pause();
    }
    return 42; /* not reached */
}
